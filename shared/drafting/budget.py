"""How many draft nodes to send each round: the count that maximizes expected tokens per second.

A round with the drafter's best n nodes is expected to commit 1 + sum_{i<n} a_i tokens, where
a_i is the measured rate at which the i-th best node was on the accepted path (drafters emit
nodes best first, so the best n are always the first n). It costs T_verify(n), which the server
measured and reported in Info, plus everything else in a round (link, serialization, drafting),
which the client measures from its own rounds. Sequoia (Chen et al. 2024, section 4) sizes trees
from measured costs the same way; docs/performance.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.moving_average import ema

MEMORY = 0.97  # per-round decay of acceptance statistics: about the last 30 rounds count
PRIOR_WEIGHT = 1.0  # pseudo-rounds of the prior, never decayed: untried ranks keep their prior


@dataclass(frozen=True)
class Load:
    """The last forward pass on the server: the sessions it ran and their new tokens together
    (batched verification, cloud_server/decoding/batching.py)."""

    sessions: int = 1
    tokens: int = 0


ALONE = Load()


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
        self._tokens = 1 + nodes  # [max_nodes]: a tree of i + 1 nodes forwards i + 2 tokens
        self._last = 1  # the size chosen last

    def acceptance(self) -> np.ndarray:
        """a: [max_nodes], the estimated rate at which each rank is accepted."""
        return ((self._hits + PRIOR_WEIGHT * self._prior)
                / (self._offered + PRIOR_WEIGHT))

    def nodes(self, load: Load = ALONE) -> int:
        """The size with the most tokens per ms. Alone, a tree's own; in a batched forward,
        the whole forward's: every node a tree adds slows the other sessions' step as much as
        its own, so under load a node must be worth the tokens the forward commits per ms of
        it, and trees shrink instead of crowding the others out."""
        if self.fixed is not None:
            return self.fixed
        expected_tokens = 1.0 + np.cumsum(self.acceptance())  # [max_nodes]
        others = max(0, load.sessions - 1)
        if others == 0:
            rate = expected_tokens / (self._other_ms + self._verify_ms)
        else:  # the others are assumed to commit what this tree did at its last size
            their_tokens = max(0, load.tokens - (1 + self._last))
            forward_ms = self._forward_ms(their_tokens + self._tokens)
            rate = (others * expected_tokens[self._last - 1] + expected_tokens) / (
                self._other_ms + forward_ms)
        self._last = int(np.argmax(rate)) + 1
        return self._last

    def _forward_ms(self, tokens: np.ndarray) -> np.ndarray:
        """A forward's time for `tokens` new tokens: the measured curve, continued past its
        end with its last slope."""
        slope = self._verify_ms[-1] - self._verify_ms[-2] if self.max_nodes > 1 else 0.0
        return np.interp(tokens, self._tokens, self._verify_ms) + slope * np.maximum(
            0, tokens - self._tokens[-1])

    def observe(self, sent: int, accepted_nodes: Sequence[int], round_ms: float,
                verify_ms: float) -> None:
        self._offered *= MEMORY
        self._hits *= MEMORY
        self._offered[:sent] += 1.0
        self._hits[[i for i in accepted_nodes if i < self.max_nodes]] += 1.0
        other = max(round_ms - verify_ms, 0.0)
        # 0.0 counts as nothing measured yet: the next round's time replaces it
        self._other_ms = ema(self._other_ms or None, other, 0.2)
