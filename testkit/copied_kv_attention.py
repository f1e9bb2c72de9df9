"""Grouped-query attention as the textbook writes it: each query head against its own copy of
the K/V head it shares. The reference for cloud_server/moa/layers.py's Attention (which stacks
the query heads instead, copying nothing) in tests/test_moa_model.py, and the baseline it is
timed against in benchmarks/edge_step_gqa.py."""
from __future__ import annotations

import math

import torch

from cloud_server.moa.layers import Attention


def copied_kv_forward(self: Attention, x: torch.Tensor, positions: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Attention.forward's contract: x: [batch, n, width]; keys, values: [batch, kv_heads, m,
    hd]; mask: additive, broadcastable to [batch, heads, n, m] -> [batch, n, width]"""
    q = self.rotary(self._split(self.q_proj(x), self.heads), positions)  # [b, h, n, hd]
    groups = self.heads // self.kv_heads
    keys = keys.repeat_interleave(groups, dim=1)  # [b, h, m, hd]
    values = values.repeat_interleave(groups, dim=1)  # [b, h, m, hd]
    scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, h, n, m]
    if mask is not None:
        scores = scores + mask
    return self.o_proj((scores.softmax(-1) @ values).transpose(1, 2).flatten(-2))
