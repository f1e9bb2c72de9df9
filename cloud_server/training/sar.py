"""Training a semi-autoregressive drafter: Falcon (Gao et al., AAAI 2025, arXiv 2412.12639).

The MoA network with `config.block` = k > 1. Training sequences are cut into blocks of k
positions whose tokens see each other: the relaxed causal mask (paper section 3.1), a query
sees every position up to its block's end. The block's m-th query, k - 1 - m positions before
that end, learns the token k positions after itself, so one step over the last k tokens of a
text drafts the next k (edge_client/drafters/falcon.py). Its loss is MoA's (`distill_loss`)
against the target's state k - 1 positions later. A whole block's Cross-Attention sees the
activations up to the verified boundary before the block's end, as in the edge's first step
of a round. The blocks' phase is drawn per batch, since the edge's blocks end wherever the
text does.

Coupled Sequential Glancing Distillation (section 3.2): a first pass without gradients counts
each sequence's wrong top-1 predictions; a rate lambda times that many block starts then get,
as input, the ground truth of what they predict (the token k on and, coupled, its activation
row), so the block's other queries learn to draft given the block's true first token. Lambda
falls linearly over training, from `glance` to a tenth (the paper's code: 0.45 to 0.10). The
second pass gives the loss.

Departures from the paper, because the drafter is split (docs/architecture.md, Drafters):
Falcon's queries read the target's feature of every position fused with the token (an LSTM),
and drafted blocks read the drafter's own predicted features; here a query reads its token's
embedding, and the target's activations reach it through Cross-Attention over verified
positions only, as in MoA, so nothing the drafter predicts is fed back. Glanced positions are
left out of the loss (their answer is their input).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf
from cloud_server.training.distill import distill_loss

if TYPE_CHECKING:
    from cloud_server.training.settings import TrainSettings

GLANCE_END = 0.1  # lambda at the end of training, as a fraction of its start


def block_ends(length: int, block: int, phase: int) -> torch.Tensor:
    """[length]: the last position of each position's block; blocks start at `phase`,
    phase + block, ... (positions before `phase` form a shorter first block)."""
    positions = torch.arange(length)
    return ((positions - phase).div(block, rounding_mode="floor") + 1) * block - 1 + phase


def relaxed_mask(ends: torch.Tensor) -> torch.Tensor:
    """Additive SA mask [1, 1, T, T]: query i sees every position up to ends[i]."""
    columns = torch.arange(len(ends))
    return additive_mask(columns[None, :] <= ends[:, None])[None, None]


def shifted(rows: torch.Tensor, by: int) -> torch.Tensor:
    """[b, T, ...] -> [b, T, ...] with row i holding row i + by (zeros past the end)."""
    if by == 0:
        return rows
    return torch.cat((rows[:, by:], torch.zeros_like(rows[:, :by])), dim=1)


def glance(ids: torch.Tensor, memory: torch.Tensor, wrong: torch.Tensor,
           candidates: torch.Tensor, rate: float, block: int, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSGD's glancing: per sequence, int(rate * wrong predictions) of the `candidates`
    positions j, drawn at random, take the token and memory row of j + block.

    ids: [b, T]; memory: [b, T, width]; wrong, candidates: [b, T] bool (every candidate has a
    position j + block) -> ids, memory, glanced [b, T] bool."""
    ids, memory = ids.clone(), memory.clone()
    glanced = torch.zeros_like(candidates)
    for row in range(ids.shape[0]):
        where = candidates[row].nonzero().flatten()
        count = min(len(where), int(rate * int(wrong[row].sum())))
        if count == 0:
            continue
        chosen = where[torch.randperm(len(where), generator=generator)[:count].to(where.device)]
        ids[row, chosen] = ids[row, chosen + block]
        memory[row, chosen] = memory[row, chosen + block]
        glanced[row, chosen] = True
    return ids, memory, glanced


def glance_rate(settings: "TrainSettings", progress: float) -> float:
    """Lambda after `progress` (0..1) of training: linear from settings.glance to a tenth."""
    return settings.glance * (1 - (1 - GLANCE_END) * min(1.0, progress))


def block_loss(edge: EdgeHalf, ids: torch.Tensor, memory: torch.Tensor,
               target_hidden: torch.Tensor, select: torch.Tensor, cross: torch.Tensor,
               settings: "TrainSettings", progress: float, generator: torch.Generator
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The semi-autoregressive student's loss on one batch (module docstring).

    ids: [b, T]; memory: [b, T, width] (its Cross-Attention rows); target_hidden: [b, T, width]
    normed; select: [b, T] positions whose next token is an answer token; cross: the batch's
    additive CA mask [b, 1, T, T] (boundaries.py) -> loss, stats (with the glanced share)."""
    block, length = edge.config.block, ids.shape[1]
    phase = int(torch.randint(0, block, (1,), generator=generator))
    ends = block_ends(length, block, phase)
    sa = relaxed_mask(ends).to(ids.device)
    ca = cross[:, :, ends.clamp(max=length - 1).to(cross.device)]  # [b, 1, T, T]
    valid = shifted(select, block - 1)  # [b, T]: the token `block` on is an answer token
    targets = shifted(target_hidden, block - 1)  # [b, T, width]
    glanced = torch.zeros_like(valid)
    rate = glance_rate(settings, progress)
    if rate > 0:
        with torch.no_grad():
            guess = edge.logits(edge(ids, memory, sa, ca)[0]).argmax(-1)  # [b, T]
            wrong = valid & (guess != edge.logits(targets).argmax(-1))
        starts = (torch.arange(length) == ends - block + 1).to(ids.device)  # [T]
        ids, memory, glanced = glance(ids, memory, wrong, valid & starts, rate, block,
                                      generator)
    keep = valid & ~glanced
    hidden, _ = edge(ids, memory, sa, ca)  # [b, T, width]
    loss, stats = distill_loss(edge, hidden[keep], targets[keep], settings)
    return loss, stats | {"glanced": float(glanced.sum()) / max(1, int(valid.sum()))}
