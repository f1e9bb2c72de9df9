"""The drafter's q on the wire, for drafts sampled from it (docs/architecture.md, Verification, SpecInfer).

For each node whose children were drawn, the distribution they were drawn from, as its support
(tokens) and probabilities: a drafter draws from its top-k, so that is all there is to send.
The server turns these into the q rows the acceptance rule reads, and refuses what cannot be a
distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.errors import InvalidRequest
from shared.tree import ROOT, DraftTree

MAX_SUPPORT = 64  # tokens per node's q


@dataclass(frozen=True)
class Proposal:
    """A drafted tree and, under acceptance sampled-drafts, for every node whose children were
    drawn, the q they were drawn from (empty for a tree chosen without drawing)."""

    tree: DraftTree
    q: tuple["NodeQ", ...] = ()


@dataclass(frozen=True)
class NodeQ:
    node: int  # ROOT: the distribution the first level was drawn from
    tokens: tuple[int, ...]
    probs: tuple[float, ...]


def point_masses(tree: DraftTree) -> tuple[NodeQ, ...]:
    """q for a tree with one child per node (a chain, offline text, a guess): a point mass on
    that child. Verifying with it is exactly the deterministic-draft rule (q(x) = 1)."""
    qs = []
    for parent in (ROOT, *range(len(tree))):
        children = tree.children(parent)
        if len(children) > 1:
            raise ValueError("point masses describe one child per node only")
        if children:
            qs.append(NodeQ(parent, (tree.tokens[children[0]],), (1.0,)))
    return tuple(qs)


class QRows:
    """q: [1 + n, vocab] as the acceptance rule indexes it (row i + 1 after node i), built row
    by row on demand from the sparse NodeQs, after checking them against the tree."""

    def __init__(self, tree: DraftTree, qs: tuple[NodeQ, ...], vocab: int):
        self._vocab = vocab
        self._rows: dict[int, NodeQ] = {}
        for q in qs:
            self._check(q, len(tree))
            self._rows[q.node + 1] = q
        missing = next((p for p in set(tree.parents) if p + 1 not in self._rows), None)
        if missing is not None:
            raise InvalidRequest(f"sampled drafts need q for every node with children; node "
                                 f"{missing} has none")

    def _check(self, q: NodeQ, n: int) -> None:
        if not ROOT <= q.node < n:
            raise InvalidRequest(f"q given for node {q.node}, the tree has {n} nodes")
        if q.node + 1 in self._rows:
            raise InvalidRequest(f"q given twice for node {q.node}")
        if not 0 < len(q.tokens) == len(q.probs) <= MAX_SUPPORT:
            raise InvalidRequest(f"q of node {q.node} needs 1 to {MAX_SUPPORT} tokens, each "
                                 "with a probability")
        if len(set(q.tokens)) != len(q.tokens) or not all(0 <= t < self._vocab for t in q.tokens):
            raise InvalidRequest(f"q of node {q.node} repeats a token or has one outside "
                                 f"[0, {self._vocab})")
        if not all(math.isfinite(x) and x >= 0 for x in q.probs) or sum(q.probs) <= 0:
            raise InvalidRequest(f"q of node {q.node} is not a distribution")

    def __getitem__(self, row: int) -> np.ndarray:
        dense = np.zeros(self._vocab)  # [vocab]
        q = self._rows.get(row)
        if q is not None:
            dense[list(q.tokens)] = q.probs
        return dense
