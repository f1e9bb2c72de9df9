"""Drafters whose drafts are right by construction, for the tests that need accepted drafts or
a given tree shape whatever a briefly trained drafter happens to draft on this CPU's kernels.

They read the target's own next-token logits from a copy of it loaded apart from the server's
(`TargetCopy`), so what they draft is what the server's verification picks, up to the rounding
the near-tie rule allows (cloud_server/reference.py). They are Drafters
(shared/drafting/base.py) that a test lends an EdgeClient in place of the one it names; they
know nothing of the wire or the server.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from shared.acceptance import AcceptanceMode
from shared.draft_q import MAX_SUPPORT, NodeQ, Proposal
from shared.drafting.base import DrafterName, TextDrafter
from shared.sampling import SamplingParams, warp
from shared.tree import ROOT, DraftTree


class TargetCopy:
    """The target's next-token logits after any context, from its checkpoint loaded on its own
    (fp32, on the CPU): no engine, hook or thread of the server's touches it."""

    def __init__(self, model_dir: Path | str):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self._logits: dict[tuple[int, ...], np.ndarray] = {}

    @torch.inference_mode()
    def logits(self, context: Sequence[int]) -> np.ndarray:
        """[vocab] float64: the logits of the token after `context` (not empty)."""
        key = tuple(int(t) for t in context)
        if key not in self._logits:
            out = self.model(input_ids=torch.tensor([key])).logits[0, -1]
            self._logits[key] = out.double().numpy()
        return self._logits[key]

    def greedy(self, context: Sequence[int], n: int) -> list[int]:
        """The target's `n` greedy tokens after `context` (argmax, lowest index on ties)."""
        ids = list(context)
        for _ in range(n):
            ids.append(int(self.logits(ids).argmax()))
        return ids[len(context):]


class _Oracle(TextDrafter):
    # It stands in for the drafter the client was opened with; the name only labels messages.
    name = DrafterName.PLD
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, target: TargetCopy, max_depth: int):
        self.target = target
        self.max_depth = max_depth
        self.accepted: list[int] = []  # nodes each verified draft got accepted

    def reset(self, prompt: Sequence[int]) -> None:
        pass

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        self.accepted.append(len(accepted_nodes))


class TwinBranchOracle(_Oracle):
    """Greedy. Drafts the target's greedy continuation g1..gk twice: under a decoy first token
    (any but g1) and then under g1, in breadth-first order. So the subtree g2..gk under g1
    repeats the one under the decoy: a draft graph sends it as an alias (shared/draft_graph.py,
    `fold`), and every token the server accepts past g2 comes from the subtree it unrolled
    there. Each round should accept g1..gk; where the server did not unroll the alias, at most
    g1 and g2."""

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        k = min(self.max_depth, max_nodes // 2)
        if k < 1:
            return DraftTree((), ())
        g = self.target.greedy(context, k)
        decoy = (g[0] + 1) % self.target.vocab_size
        tokens, parents = [decoy, g[0]], [ROOT, ROOT]
        for depth in range(1, k):  # level `depth`: the decoy's branch, then g1's
            tokens += [g[depth], g[depth]]
            parents += [2 * depth - 2, 2 * depth - 1]
        return DraftTree(tuple(tokens), tuple(parents))

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        raise NotImplementedError("TwinBranchOracle drafts for greedy acceptance only")


class SupportOracle(_Oracle):
    """Sampling under `sampling`, whose warp must leave at most `max_nodes` and MAX_SUPPORT
    tokens (a top-k): the first level is every token the target's warped p allows.

    topk-drafts tries the children in order, accepting x with p(x) renormalised over those not
    yet tried, so with p's whole support drafted one child is accepted with probability 1.
    sampled-drafts: the children are drawn from q = p without replacement and q goes along,
    so the first is accepted with probability min(1, p/q) = 1. Either way every round accepts
    a draft, up to the rounding between this copy's p and the server's."""

    def __init__(self, target: TargetCopy, sampling: SamplingParams, max_depth: int):
        super().__init__(target, max_depth)
        self.sampling = sampling

    def _support(self, context: Sequence[int], max_nodes: int) -> tuple[list[int], np.ndarray]:
        """p's support, most likely first, and p there."""
        p = warp(self.target.logits(context), self.sampling)  # [vocab]
        order = [int(t) for t in np.argsort(-p, kind="stable") if p[t] > 0]
        if len(order) > min(max_nodes, MAX_SUPPORT):
            raise ValueError(f"p allows {len(order)} tokens, more than the {max_nodes} nodes "
                             f"or the {MAX_SUPPORT} of q's support: sample with a smaller top_k")
        return order, p[order]

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        support, _ = self._support(context, max_nodes)
        return DraftTree(tuple(support), (ROOT,) * len(support))

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        support, probs = self._support(context, max_nodes)
        q = (probs / probs.sum()).astype(np.float32)  # as the wire carries it
        keys = np.log(q.astype(np.float64)) + rng.gumbel(size=len(q))  # Gumbel top-k
        drawn = [support[j] for j in np.argsort(-keys)]  # all of them, without replacement
        return Proposal(DraftTree(tuple(drawn), (ROOT,) * len(drawn)),
                        (NodeQ(ROOT, tuple(support), tuple(map(float, q))),))
