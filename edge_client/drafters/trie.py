"""A token trie that merges scored draft sequences and keeps the best nodes as one DraftTree.

Shared by the training-free drafters (DESIGN section 3.3): they find candidate continuations,
the trie merges common prefixes so a shared prefix is drafted once (DESIGN section 3.4, after
Graph-structured SD), and EAGLE-2's rule keeps the `max_nodes` highest-scored nodes. It knows
nothing of how the candidates were found.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from shared.tree import ROOT, DraftTree


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
        new_index = {node: i for i, node in enumerate(kept)}
        parents = tuple(ROOT if self._parents[n] == ROOT else new_index[self._parents[n]]
                        for n in kept)
        return DraftTree(tuple(self._tokens[n] for n in kept), parents)
