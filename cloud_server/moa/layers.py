"""Building blocks of the MoA drafter: RMSNorm, RoPE, attention with explicit K/V, SwiGLU, and
the pre-norm block made of them.

Attention here takes its keys and values as tensors rather than owning a cache, so one module
serves self-attention (K/V from the same tokens), cross-attention (K/V from the activation
memory) and the ONNX export, where the edge keeps the K/V state itself. Scores are computed with
plain matmuls (no fused kernel) so the traced graph is the same on every backend.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))  # [width]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., width] -> [..., width]"""
        variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
        return x * torch.rsqrt(variance + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer, Su et al. 2021), rotate-half layout as in Llama."""

    inv_freq: torch.Tensor  # buffer: [hd / 2]

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # [hd / 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, n, hd], positions: [n] or [batch, n] -> [..., heads, n, hd]"""
        angles = positions[..., None].float() * self.inv_freq  # [(batch,) n, hd / 2]
        angles = torch.cat((angles, angles), dim=-1)  # [(batch,) n, hd]
        if angles.dim() == 3:
            angles = angles[:, None]  # [batch, 1, n, hd]: broadcast over heads
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., heads, n, hd]
        return x * angles.cos() + rotated * angles.sin()


class Attention(nn.Module):
    """Grouped-query attention whose K/V come from `project_kv` on any source sequence."""

    def __init__(self, width: int, source_width: int, heads: int, kv_heads: int, head_dim: int,
                 rotary: Rotary) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(source_width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(source_width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.rotary = rotary

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """x: [batch, n, heads * hd] -> [batch, heads, n, hd]"""
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def project_kv(self, source: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [batch, m, source_width] -> keys, values: [batch, kv_heads, m, hd]"""
        keys = self.rotary(self._split(self.k_proj(source), self.kv_heads), positions)
        return keys, self._split(self.v_proj(source), self.kv_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x: [batch, n, width]; keys, values: [batch, kv_heads, m, hd];
        mask: additive, [batch or 1, 1, n, m] (the same for every head) -> [batch, n, width]

        The query heads that share a K/V head are stacked as rows against it (head
        k * groups + j, as repeat_interleave would pair them), so the K/V are never copied per
        head: on the edge that copy grew with the text (LOG edge_step_gqa)."""
        q = self.rotary(self._split(self.q_proj(x), self.heads), positions)  # [b, h, n, hd]
        groups = self.heads // self.kv_heads
        b, _, n, hd = q.shape
        q = q.reshape(b, self.kv_heads, groups * n, hd)  # [b, kvh, groups * n, hd]
        scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, kvh, g * n, m]
        if mask is not None:
            scores = scores + mask.repeat(1, 1, groups, 1)
        out = (scores.softmax(-1) @ values).reshape(b, self.heads, n, hd)  # [b, h, n, hd]
        return self.o_proj(out.transpose(1, 2).flatten(-2))  # [b, n, width]


class SwiGLU(nn.Module):
    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, intermediate, bias=False)
        self.up_proj = nn.Linear(width, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., width] -> [..., width]"""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-norm attention + MLP block; K/V come from `memory` (itself for self-attention)."""

    def __init__(self, width: int, memory_width: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, rotary: Rotary, eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = Attention(width, memory_width, heads, kv_heads, head_dim, rotary)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = SwiGLU(width, intermediate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x: [batch, n, width]; keys, values: [batch, kv_heads, m, hd] -> [batch, n, width]"""
        h = x + self.attn(self.attn_norm(x), positions, keys, values, mask)
        return h + self.mlp(self.mlp_norm(h))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """allowed: bool [...] -> [...] with 0 where allowed and the dtype's minimum elsewhere.

    The minimum rather than -inf keeps a fully masked row finite (uniform weights), so rows that
    the loss ignores never put NaN into the gradients."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)
