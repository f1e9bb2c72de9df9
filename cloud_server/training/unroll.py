"""Training a recurrent drafter as it drafts: the training-time test (EAGLE-3, Li et al. 2025,
section 3.3; HASS, Zhang et al. 2024).

A recurrent drafter (MoaConfig.recurrent) reads, with each token, the previous position's
feature: the server's activation where that position is verified, its own output through the
server half where it drafted it. Teacher forcing would always hand it the server's, so it would
never learn from its own. Here the sequence runs through the edge half in passes: pass 1 feeds
the server's activations everywhere, which is exact for the positions right after a verified
boundary (distance 1: the first draft of a round); pass k feeds every position past its boundary
its own output of pass k - 1, which is exact at distance k. Each position's loss is taken from
the pass that matches its distance, the last pass standing in for every distance beyond it.

Self-Attention keys, as the edge keeps them (edge_client/drafters/moa.py): a query at distance
d sees the positions up to its boundary + 1 computed from verified features (the edge recomputes
them when the activations arrive) and the positions drafted after that from its own.
"""
from __future__ import annotations

import torch
from torch import nn

from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf


def unrolled(edge: EdgeHalf, fusion: nn.Module | None, ids: torch.Tensor,
             activations: torch.Tensor, boundary: torch.Tensor, passes: int) -> torch.Tensor:
    """The normed outputs a drafter gives while drafting.

    ids: [b, T]; activations: [b, T, width], the CA memory rows of every position (the server
    half's output); fusion: the server half of a recurrent drafter, which its own outputs go
    through; boundary: [b, T], b(i) the last verified position before i (boundaries.py);
    passes: >= 1 -> [b, T, width], position i from pass min(i - b(i), passes). A drafter that
    is not recurrent needs one pass whatever the distance."""
    if edge.feature_in is None or fusion is None:
        passes = 1
    length = ids.shape[1]
    positions = torch.arange(length, device=ids.device)  # [T]
    distance = positions[None] - boundary  # [b, T], >= 1
    verified = _previous(activations)  # [b, T, width]: row i holds position i - 1's activation
    true_x = edge.inputs(ids, verified)  # [b, T, width]
    true_keys, true_values = edge.sa_kv_of(true_x, positions)
    mem_keys, mem_values = edge.memory_kv(activations, positions)
    ca_mask = additive_mask(positions[None, None, :] <= boundary[:, :, None])[:, None]
    causal = positions[None, :] <= positions[:, None]  # [T, T]
    from_verified = positions[None, None, :] <= boundary[:, :, None] + 1  # [b, T, T]
    sa_mask = additive_mask(torch.cat((causal & from_verified, causal & ~from_verified),
                                      dim=-1))[:, None]  # [b, 1, T, 2T]
    out = torch.zeros_like(activations)
    x = true_x
    for k in range(1, passes + 1):
        keys, values = edge.sa_kv_of(x, positions)
        h = edge.raw(x, positions, torch.cat((true_keys, keys), dim=2),
                     torch.cat((true_values, values), dim=2), sa_mask, mem_keys, mem_values,
                     ca_mask)  # [b, T, width]
        take = distance == k if k < passes else distance >= k  # [b, T]
        out = torch.where(take[..., None], h, out)
        if k < passes:
            assert fusion is not None
            own = _previous(fusion(h[..., None, :]))  # [b, T, width]
            x = edge.inputs(ids, torch.where((distance <= 1)[..., None], verified, own))
    return edge.normed(out)


def _previous(rows: torch.Tensor) -> torch.Tensor:
    """[b, T, width] -> [b, T, width] shifted one position later, zeros first."""
    return torch.cat((torch.zeros_like(rows[:, :1]), rows[:, :-1]), dim=1)
