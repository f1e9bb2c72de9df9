"""Where the target runs (`cloud-server --device`); apart from target.py so the CLI parses it
without importing torch."""
from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    AUTO = "auto"  # a CUDA GPU when torch sees one, else the CPU
    CPU = "cpu"
    CUDA = "cuda"
