"""`edge-client serve`: an OpenAI-compatible HTTP endpoint on the laptop, backed by split
decoding (docs/usage.md, "An OpenAI-compatible endpoint")."""
