"""Grouped-query attention over a tree or a prompt chunk without copying the cache's heads.

With a mask, transformers' sdpa attention repeats each key and value head for the query heads
that share it (`repeat_kv`) before calling torch's kernel, unless the query is one token: a
copy of the whole cache, per layer, per forward. A tree verification always has a mask, so
every speculative forward paid it, and a batched one paid it per session. torch's kernel takes
the grouping itself (`enable_gqa`), and on the CPU gives the same bits, faster (results log,
`grouped_attention`). A one-token query keeps transformers'
own path, which regroups the query instead and differs from `enable_gqa` by rounding (1e-7):
a plain decoding step stays exactly what it was.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

Attention = Callable[..., tuple[torch.Tensor, Any]]


def grouped(sdpa: Attention) -> Attention:
    """transformers' sdpa attention function, with masked multi-token queries on the CPU
    grouped in torch's kernel instead of over repeated key and value heads."""
    def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
               scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if (attention_mask is None or query.shape[2] == 1 or key.shape[1] == query.shape[1]
                or query.device.type != "cpu" or dropout or kwargs.get("position_bias")
                is not None or kwargs.get("softcap") is not None):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # [batch, new, heads, head_dim]
    return attend
