"""Where both sides keep what they download or convert once."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """SPLITDEC_CACHE, else ~/.cache/splitdec."""
    return Path(os.environ.get("SPLITDEC_CACHE", Path.home() / ".cache" / "splitdec"))
