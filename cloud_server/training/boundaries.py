"""Which activations each training position may see: the verified boundary (docs/architecture.md, Drafters).

At inference the server sends activations after each round for every committed token but the
last (the bonus token is not in its cache yet), so the edge drafts the token after position i
seeing activations only up to some earlier position b(i) < i, and up to b(i) + depth + pipelined
rounds further out. Training reproduces that: the prompt is verified, and inside the answer a
boundary falls every k tokens, k drawn in [6, 14] per sequence with a random phase (the paper's
"variable future length", section 4). Position i sees activations j <= b(i), where b(i) is the
last boundary before i.
"""
from __future__ import annotations

import torch

from cloud_server.moa.layers import additive_mask

MIN_EVERY = 6
MAX_EVERY = 14


def last_boundary(prompt_len: int, length: int, every: int, phase: int) -> torch.Tensor:
    """b: [length] with b[i] the last verified boundary < i (-1 when none).

    Boundaries: every prompt position, then answer positions prompt_len + phase + t * every."""
    positions = torch.arange(length)  # [length]
    is_boundary = positions < prompt_len
    offset = positions - prompt_len - phase
    is_boundary |= (offset >= 0) & (offset % every == 0)
    marked = torch.where(is_boundary, positions, torch.full_like(positions, -1))  # [length]
    through = torch.cummax(marked, dim=0).values  # [length]: last boundary <= i
    return torch.cat((torch.tensor([-1]), through[:-1]))  # [length]: last boundary < i


def cross_mask(prompt_lens: list[int], length: int,
               generator: torch.Generator) -> torch.Tensor:
    """Additive CA mask: [batch, 1, length, length]; row i of a sequence sees columns <= b(i)."""
    rows = []
    for prompt_len in prompt_lens:
        every = int(torch.randint(MIN_EVERY, MAX_EVERY + 1, (1,), generator=generator))
        phase = int(torch.randint(0, every, (1,), generator=generator))
        b = last_boundary(prompt_len, length, every, phase)  # [length]
        rows.append(torch.arange(length)[None, :] <= b[:, None])  # [length, length]
    return additive_mask(torch.stack(rows))[:, None]


def causal_mask(length: int) -> torch.Tensor:
    """Additive SA mask: [1, 1, length, length]."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    return additive_mask(allowed)[None, None]
