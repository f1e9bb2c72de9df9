"""A token trie that merges scored draft sequences and keeps the best nodes as one DraftTree.

Shared by the training-free drafters (docs/architecture.md, Drafters): they find candidate continuations,
the trie merges common prefixes so a shared prefix is drafted once, and EAGLE-2's rule keeps the `max_nodes` highest-scored nodes. It knows
nothing of how the candidates were found.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from shared.draft_q import NodeQ, Proposal
from shared.tree import ROOT, DraftTree

SAMPLED_WIDTHS = (4, 2)  # children drawn per expanded node: at the first level, then deeper


class TokenTrie:
    """Nodes keyed by (parent, token), so a token can never repeat under one parent.

    A node's score is the sum of the scores added to it: when several candidates agree on a
    prefix, their evidence adds up. A drafter that scores each node once just adds it once.
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._scores: list[float] = []
        self._node: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        self._children: dict[int, list[int]] = {}  # parent (ROOT too) -> nodes, creation order

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, parent: int, token: int, score: float) -> int:
        """The node for `token` under `parent`, created when new; `score` adds to its score."""
        node = self._node.get((parent, token))
        if node is None:
            node = len(self._tokens)
            self._tokens.append(token)
            self._parents.append(parent)
            self._scores.append(0.0)
            self._node[(parent, token)] = node
            self._children.setdefault(parent, []).append(node)
        self._scores[node] += score
        return node

    def add_path(self, tokens: Sequence[int], scores: Sequence[float]) -> None:
        """Adds a sequence continuing the committed text; `scores[i]` goes to its i-th node."""
        parent = ROOT
        for token, score in zip(tokens, scores):
            parent = self.add(parent, token, score)

    def best_tree(self, max_nodes: int) -> DraftTree:
        """The best `max_nodes` nodes, picked best-first from the roots.

        A node becomes eligible once its parent is kept, so the result is always a tree and
        comes out in topological order even when scores do not fall with depth. Ties go to
        the earlier-created node, which keeps the result deterministic.
        """
        heap = [(-self._scores[n], n) for n in self._children.get(ROOT, [])]
        heapq.heapify(heap)
        kept: list[int] = []
        while heap and len(kept) < max_nodes:
            _, node = heapq.heappop(heap)
            kept.append(node)
            for child in self._children.get(node, []):
                heapq.heappush(heap, (-self._scores[child], child))
        return self._tree(kept)

    def sampled_tree(self, max_nodes: int, rng: np.random.Generator,
                     widths: tuple[int, int] = SAMPLED_WIDTHS
                     ) -> Proposal:
        """A tree whose children are draws from q, for acceptance sampled-drafts, and those q.

        A node's q is its trie children's scores, normalised (in float32, as the wire carries
        them). Nodes are expanded best first by the q-probability of their path (EAGLE-2's
        dynamic tree); an expanded node draws all its children at once, without replacement
        (Gumbel top-k), as many as `widths` and the remaining budget allow. That count is fixed
        before the node draws, never by what it draws: the condition under which recursive
        rejection sampling over these children stays exact (SpecInfer section 4.3; RSD).
        """
        kept: list[int] = []
        qs: list[NodeQ] = []
        heap = [(-1.0, ROOT, ROOT)]  # (-path probability, trie node, its index in the tree)
        while heap and len(kept) < max_nodes:
            neg_prob, node, index = heapq.heappop(heap)
            kids = [k for k in self._children.get(node, []) if self._scores[k] > 0]
            if not kids:
                continue
            q = np.array([self._scores[k] for k in kids], dtype=np.float32)  # [k]
            q /= q.sum()
            width = min(widths[node != ROOT], len(kids), max_nodes - len(kept))
            keys = np.log(q.astype(np.float64)) + rng.gumbel(size=len(kids))  # [k]
            qs.append(NodeQ(index, tuple(self._tokens[k] for k in kids), tuple(map(float, q))))
            for j in np.argsort(-keys)[:width]:
                kept.append(kids[j])
                heapq.heappush(heap, (neg_prob * float(q[j]), kids[j], len(kept) - 1))
        return Proposal(self._tree(kept), tuple(qs))

    def _tree(self, kept: list[int]) -> DraftTree:
        """The kept trie nodes (parents before children) as a DraftTree, in that order."""
        new_index = {node: i for i, node in enumerate(kept)}
        parents = tuple(ROOT if self._parents[n] == ROOT else new_index[self._parents[n]]
                        for n in kept)
        return DraftTree(tuple(self._tokens[n] for n in kept), parents)
