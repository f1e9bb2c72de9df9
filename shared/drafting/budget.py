"""How many draft nodes to send each round: the count that maximizes expected tokens per second.

A round with the drafter's best n nodes is expected to commit 1 + sum_{i<n} a_i tokens, where
a_i is the measured rate at which the i-th best node was on the accepted path (drafters emit
nodes best first, so the best n are always the first n). It costs T_verify(n), which the server
measured and reported in Info, plus everything else in a round (link, serialization, drafting),
which the client measures from its own rounds. Sequoia (Chen et al. 2024, section 4) sizes trees
from measured costs the same way; docs/performance.md.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MEMORY = 0.97  # per-round decay of acceptance statistics: about the last 30 rounds count
PRIOR_WEIGHT = 1.0  # pseudo-rounds of the prior, never decayed: untried ranks keep their prior


def prior_rates(max_nodes: int) -> np.ndarray:
    """Optimistic starting acceptance rates, falling with rank: [max_nodes]."""
    return 0.6 / (1.0 + np.arange(max_nodes))


class TreeBudget:
    def __init__(self, verify_costs: Sequence[tuple[int, float]], max_nodes: int,
                 fixed: int | None = None):
        self.max_nodes = max_nodes
        self.fixed = None if fixed is None else min(fixed, max_nodes)
        nodes = np.arange(1, max_nodes + 1)
        if verify_costs:
            xs, ys = zip(*verify_costs)
            self._verify_ms = np.interp(nodes, xs, ys)  # [max_nodes], entry i: i + 1 nodes
        else:  # a server that reports no costs: assume each node adds 1/16 of a forward
            self._verify_ms = 1.0 + nodes / 16.0
        self._prior = prior_rates(max_nodes)
        self._offered = np.zeros(max_nodes)  # decayed count of rounds that sent rank i
        self._hits = np.zeros(max_nodes)  # ... in which rank i was accepted
        self._other_ms = 0.0  # a round's time beyond verification, smoothed

    def acceptance(self) -> np.ndarray:
        """a: [max_nodes], the estimated rate at which each rank is accepted."""
        return ((self._hits + PRIOR_WEIGHT * self._prior)
                / (self._offered + PRIOR_WEIGHT))

    def nodes(self) -> int:
        if self.fixed is not None:
            return self.fixed
        expected_tokens = 1.0 + np.cumsum(self.acceptance())  # [max_nodes]
        return int(np.argmax(expected_tokens / (self._other_ms + self._verify_ms))) + 1

    def observe(self, sent: int, accepted_nodes: Sequence[int], round_ms: float,
                verify_ms: float) -> None:
        self._offered *= MEMORY
        self._hits *= MEMORY
        self._offered[:sent] += 1.0
        self._hits[[i for i in accepted_nodes if i < self.max_nodes]] += 1.0
        other = max(round_ms - verify_ms, 0.0)
        self._other_ms = other if self._other_ms == 0.0 else 0.8 * self._other_ms + 0.2 * other
