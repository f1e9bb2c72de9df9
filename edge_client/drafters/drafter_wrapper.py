"""A drafter around another, forwarding all but what it changes: prompt-lookup nodes
(lookup_merge.py), race ranking (race_aware.py), calibration walks (static_trees.RankWalker).
"""
from __future__ import annotations

from typing import Generic, Protocol, Sequence, TypeVar

import numpy as np

from shared.draft_q import Proposal
from shared.drafting.base import Drafter, ReadsActivations
from shared.drafting.race import Race
from shared.tree import DraftTree


class PooledDrafter(Drafter, ReadsActivations, Protocol):
    """A trained drafter, or one around it: slow to build (its ONNX sessions), so a generation
    beside another drafts with a sibling over the same sessions (drafter_source.DrafterPool)."""

    def sibling(self) -> "PooledDrafter":
        """A drafter like this one with state of its own."""


Inner = TypeVar("Inner", bound=PooledDrafter)


class DrafterWrapper(Generic[Inner]):
    def __init__(self, drafter: Inner) -> None:
        self.drafter = drafter
        self.name, self.max_depth = drafter.name, drafter.max_depth
        self.sampling_acceptance = drafter.sampling_acceptance
        self.needs_activations = drafter.needs_activations

    def reset(self, prompt: Sequence[int]) -> None:
        self.drafter.reset(prompt)

    def follow_race(self, race: Race | None) -> None:
        self.drafter.follow_race(race)

    def add_activations(self, start: int, values: np.ndarray) -> None:
        self.drafter.add_activations(start, values)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        return self.drafter.propose(context, max_nodes)

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        return self.drafter.propose_sampled(context, max_nodes, rng)

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        self.drafter.observe(context, tree, accepted_nodes, tokens)
