"""A session's attention mask in one forward, for full-attention and sliding-window layers.

A forward gives each new token the cached positions and, in a tree, its own ancestors. A
sliding-window layer (Mistral, Qwen2 with use_sliding_window, Gemma 2 and 3, Phi-3) sees of
those only the keys fewer than `window` positions back, as transformers' sliding-window masks
do. The server keeps every layer's cache whole (a tree is compacted by index, kv_cache.py), so
the window lives in the mask: each layer says its window when it calls attention, and the mask
for it comes from the positions of the queries and the keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SessionMask:
    """`full`: additive [1, 1, new, cached + new]; positions of the new tokens [new] and of
    every key [cached + new] (a cached key's position is its index: caches are compacted)."""

    full: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def for_window(self, window: int | None) -> torch.Tensor:
        """The mask for a layer with this sliding window (None or 0: full attention)."""
        if not window:
            return self.full
        if window not in self._windowed:
            far = self.query_positions[:, None] - self.key_positions[None, :] >= window
            self._windowed[window] = self.full.masked_fill(far, torch.finfo(self.full.dtype).min)
        return self._windowed[window]


def sliding_window(config: object) -> int | None:
    """The window of the model's sliding-window layers; None when it has none."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)
