"""Masked multi-token queries group their heads in torch's kernel (cloud_server/engine/gqa_attention.py)
and give the very bits of transformers' repeated-heads path; one-token queries keep its path."""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from cloud_server.engine.gqa_attention import grouped


def _inputs(new: int, cached: int = 20):
    g = torch.Generator().manual_seed(new)
    query = torch.randn(1, 6, new, 8, generator=g)  # 6 query heads on 2 key-value heads
    key, value = (torch.randn(1, 2, cached + new, 8, generator=g) for _ in range(2))
    allowed = torch.rand(new, cached + new, generator=g) > 0.3
    allowed[:, 0] = True
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return query, key, value, mask[None, None]


def _module() -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    module.is_causal = True
    return module


def test_a_tree_query_gives_the_repeated_heads_bits_without_calling_their_path():
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return sdpa_attention_forward(*args, **kwargs)

    query, key, value, mask = _inputs(new=5)
    expected, _ = sdpa_attention_forward(_module(), query, key, value, mask, scaling=0.35)
    out, _ = grouped(original)(_module(), query, key, value, mask, scaling=0.35)
    assert not calls and torch.equal(out, expected)


def test_a_one_token_query_and_an_unmasked_chunk_keep_transformers_path():
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return sdpa_attention_forward(*args, **kwargs)

    attend = grouped(original)
    query, key, value, mask = _inputs(new=1)
    attend(_module(), query, key, value, mask, scaling=0.35)
    query, key, value, _ = _inputs(new=4, cached=0)
    attend(_module(), query, key, value, None, scaling=0.35)
    assert len(calls) == 2
