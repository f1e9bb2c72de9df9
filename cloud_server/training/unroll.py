"""Training a recurrent drafter as it drafts: the training-time test (EAGLE-3, Li et al. 2025,
section 3.3; HASS, Zhang et al. 2024).

A recurrent drafter (MoaConfig.recurrent) reads, with each token, the previous position's
feature: the server's activation where that position is verified, its own output through the
server half where it drafted it. Teacher forcing would always hand it the server's, so it would
never learn from its own. Here the sequence runs through the edge half in passes, and pass k
puts every position at draft depth k: its last verified position is k back, the position after
that (the round's last committed token) reads the verified feature, and the k - 1 positions
after that read the drafter's own outputs, of passes 1 .. k - 1 (pass m's output at a position
is the feature its successor reads in pass m + 1). Every position thus trains at every depth up
to the number of passes, as many losses per target pass.

Self-Attention keys follow the same chain: a query at depth k sees the verified-feature keys up
to its round's first position and, after it, the keys of its own chain, one from each pass
(the diagonal), which is what the edge holds while drafting (edge_client/drafters/moa.py).
A drafter that is not recurrent gets the same depths from the masks alone.
"""
from __future__ import annotations

import torch
from torch import nn

from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf


def unrolled(edge: EdgeHalf, fusion: nn.Module | None, ids: torch.Tensor,
             activations: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """The normed outputs a drafter gives at draft depths 1 .. `passes`.

    ids: [b, T]; activations: [b, T, width], the CA memory rows of every position (the server
    half's output); fusion: the server half of a recurrent drafter, which its own outputs go
    through (unused for a drafter that is not recurrent) -> one [b, T, width] per depth k:
    position i drafted with i - k its last verified position (rows with i < k are
    meaningless)."""
    positions = torch.arange(ids.shape[1], device=ids.device)  # [T]
    x = edge.inputs(ids, _previous(activations))  # [b, T, width]: verified features
    keys, values = edge.sa_kv_of(x, positions)
    mem_keys, mem_values = edge.memory_kv(activations, positions)
    outputs, h = [], x  # h: the previous pass's output, before the final norm
    for k in range(1, passes + 1):
        if k > 1:
            own = (_previous(fusion(h[..., None, :]))
                   if fusion is not None and edge.config.recurrent else None)
            x = edge.inputs(ids, own)
            new_keys, new_values = edge.sa_kv_of(x, positions)
            keys, values = torch.cat((keys, new_keys), 2), torch.cat((values, new_values), 2)
        boundary = positions - k  # [T]: the last verified position of each query
        ca_mask = additive_mask(positions[None, :] <= boundary[:, None])[None, None]
        h = edge.raw(x, positions, keys, values, _chain_mask(positions, k), mem_keys,
                     mem_values, ca_mask)  # [b, T, width]
        outputs.append(edge.normed(h))
    return outputs


def _chain_mask(positions: torch.Tensor, depth: int) -> torch.Tensor:
    """Additive SA mask [1, 1, T, depth * T] over the keys of passes 1 .. depth: a query i sees
    pass 1's keys up to i - depth + 1 and pass m's key at i - depth + m (m >= 2)."""
    rows, cols = positions[:, None], positions[None, :]
    parts = [cols <= rows - depth + 1]
    parts += [cols == rows - depth + m for m in range(2, depth + 1)]
    return additive_mask(torch.cat(parts, dim=1))[None, None]


def _previous(rows: torch.Tensor) -> torch.Tensor:
    """[b, T, width] -> [b, T, width] shifted one position later, zeros first."""
    return torch.cat((torch.zeros_like(rows[:, :1]), rows[:, :-1]), dim=1)
