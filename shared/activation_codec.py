"""Compact encodings of MoA activations for the wire (docs/protocol.md).

fp16 is the default: 2 * width bytes a token (1152 B for SmolLM2's 576). int8 with one fp16
scale per token (symmetric, per row) is the option: width + 2 bytes a token. Pure numpy; the
wire module decides where the bytes go.
"""
from __future__ import annotations

import numpy as np


def to_int8(activations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """activations: [n, width] float -> values: [n, width] int8, scales: [n] float16."""
    x = np.asarray(activations, dtype=np.float32)  # [n, width]
    scales = np.abs(x).max(axis=1) / 127.0  # [n]
    scales = np.where(scales > 0, scales, 1.0).astype(np.float16)  # [n]
    values = np.clip(np.rint(x / scales.astype(np.float32)[:, None]), -127, 127)
    return values.astype(np.int8), scales


def from_int8(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """values: [n, width] int8, scales: [n] float16 -> [n, width] float32."""
    return values.astype(np.float32) * scales.astype(np.float32)[:, None]
