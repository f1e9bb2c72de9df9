"""`edge-client serve`: an OpenAI-compatible HTTP endpoint on the laptop, backed by split
decoding (README, "An OpenAI-compatible endpoint")."""
