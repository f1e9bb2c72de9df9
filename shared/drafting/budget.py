"""How many draft nodes to send each round: the count that maximizes expected tokens per second.

A round with the drafter's best n nodes is expected to commit 1 + sum_{i<n} a_i tokens, where
a_i is the measured rate at which the i-th best node was on the accepted path (drafters emit
nodes best first, so the best n are always the first n). It costs T_verify(n), which the server
measured and reported in Info, plus drafting the tree, T_draft(n) = a + b n fitted to the
drafter's own measured times (`CostLine`), plus everything else in a round (link,
serialization), which the client measures from its own rounds. Sequoia (Chen et al. 2024,
section 4) sizes trees from measured costs the same way; docs/performance.md. Drafting counts
because verification alone can be flat in n (a GPU's forward of one node or 128 costs the
same), and then every node that is ever accepted looks free while each costs the drafter's
host time (results log, `host_arrays`: Token Recycling's trees wandered up to 128 nodes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.moving_average import ema

MEMORY = 0.97  # per-round decay of acceptance statistics: about the last 30 rounds count
PRIOR_WEIGHT = 1.0  # pseudo-rounds of the prior, never decayed: untried ranks keep their prior
# nodes², added to the spread of the sizes a drafting cost's slope is fitted over: sizes that
# barely varied tell little of the slope, and their slope falls back towards 0 (trees grow,
# vary again, and the slope is measured anew) instead of holding a noisy estimate
SLOPE_PRIOR_SPREAD = 4.0
# While the sizes have barely varied, one round in PROBE_EVERY sends half the chosen size: the
# cost's slope is otherwise never measured where verification is flat, since the budget then
# always asks for the largest tree
PROBE_EVERY = 16


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


class CostLine:
    """A cost a + b n (ms, n nodes), both >= 0, fitted by least squares to the rounds' measured
    (n, ms), decayed as the acceptance statistics are; 0 until measured."""

    def __init__(self) -> None:
        self._sums = np.zeros(5)  # decayed sums of 1, n, n², ms, n ms

    def observe(self, nodes: int, ms: float) -> None:
        self._sums = MEMORY * self._sums + (1.0, nodes, nodes * nodes, ms, nodes * ms)

    @property
    def spread(self) -> float:
        """The variance of the sizes measured (decayed), nodes²."""
        w, n, nn = self._sums[:3]
        return 0.0 if w == 0 else (w * nn - n * n) / (w * w)

    @property
    def slope(self) -> float:
        w, n, nn, y, ny = self._sums
        if w == 0:
            return 0.0
        return max(0.0, (w * ny - n * y) / (w * nn - n * n + SLOPE_PRIOR_SPREAD * w * w))

    def __call__(self, nodes: np.ndarray) -> np.ndarray:
        w, n, _, y, _ = self._sums
        if w == 0:
            return np.zeros_like(nodes, dtype=float)
        slope = self.slope
        return max(0.0, (y - slope * n) / w) + slope * nodes


class TreeBudget:
    def __init__(self, verify_costs: Sequence[tuple[int, float]], max_nodes: int,
                 fixed: int | None = None):
        self.max_nodes = max_nodes
        self.fixed = None if fixed is None else min(fixed, max_nodes)
        nodes = self._sizes = np.arange(1, max_nodes + 1)
        if verify_costs:
            xs, ys = zip(*verify_costs)
            self._verify_ms = np.interp(nodes, xs, ys)  # [max_nodes], entry i: i + 1 nodes
        else:  # a server that reports no costs: assume each node adds 1/16 of a forward
            self._verify_ms = 1.0 + nodes / 16.0
        self._prior = prior_rates(max_nodes)
        self._offered = np.zeros(max_nodes)  # decayed count of rounds that sent rank i
        self._hits = np.zeros(max_nodes)  # ... in which rank i was accepted
        self._other_ms = 0.0  # a round's time beyond verification and drafting, smoothed
        self._draft_ms = CostLine()  # drafting a tree of n nodes
        self._drafts_timed = 0  # rounds whose drafting was measured
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
        beside_ms = self._other_ms + self._draft_ms(self._sizes)  # [max_nodes]
        if others == 0:
            rate = expected_tokens / (beside_ms + self._verify_ms)
        else:  # the others are assumed to commit what this tree did at its last size
            their_tokens = max(0, load.tokens - (1 + self._last))
            forward_ms = self._forward_ms(their_tokens + self._tokens)
            rate = (others * expected_tokens[self._last - 1] + expected_tokens) / (
                beside_ms + forward_ms)
        self._last = int(np.argmax(rate)) + 1
        return self._probed(self._last)

    def _probed(self, best: int) -> int:
        """`best`, or half of it in a round that probes drafting's cost (PROBE_EVERY)."""
        timed = self._drafts_timed
        if (timed and timed % PROBE_EVERY == 0
                and self._draft_ms.spread < SLOPE_PRIOR_SPREAD):
            return max(1, best // 2)
        return best

    def _forward_ms(self, tokens: np.ndarray) -> np.ndarray:
        """A forward's time for `tokens` new tokens: the measured curve, continued past its
        end with its last slope."""
        slope = self._verify_ms[-1] - self._verify_ms[-2] if self.max_nodes > 1 else 0.0
        return np.interp(tokens, self._tokens, self._verify_ms) + slope * np.maximum(
            0, tokens - self._tokens[-1])

    def observe(self, sent: int, accepted_nodes: Sequence[int], round_ms: float,
                verify_ms: float, draft_ms: float | None = None) -> None:
        """A round that sent `sent` nodes: those accepted, its time apart from drafting
        (`round_ms`, of which `verify_ms` verifying), and drafting the tree in it (`draft_ms`;
        None: not measured, as for a tree drafted while the last round was away)."""
        if draft_ms is not None:
            self._draft_ms.observe(sent, draft_ms)
            self._drafts_timed += 1
        self._offered *= MEMORY
        self._hits *= MEMORY
        self._offered[:sent] += 1.0
        self._hits[[i for i in accepted_nodes if i < self.max_nodes]] += 1.0
        other = max(round_ms - verify_ms, 0.0)
        # 0.0 counts as nothing measured yet: the next round's time replaces it
        self._other_ms = ema(self._other_ms or None, other, 0.2)
