"""Draft token trees: tokens plus parent indices, from which depths, paths and masks follow.

A tree continues the committed text. Node i holds `tokens[i]`; `parents[i]` is -1 for a child
of the last committed token, otherwise an earlier node (so nodes are in topological order).
Mask and positions are never sent; both sides derive them from `parents` (docs/architecture.md, Verification).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.errors import InvalidRequest

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def chain(tokens: Sequence[int]) -> "DraftTree":
        """A single path: each token the child of the one before."""
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def depths(self) -> np.ndarray:
        """depths: [n] with 0 for children of the committed text."""
        depth = np.zeros(len(self), dtype=np.int64)
        for i, parent in enumerate(self.parents):
            depth[i] = 0 if parent == ROOT else depth[parent] + 1
        return depth

    def ancestor_mask(self) -> np.ndarray:
        """mask: [n, n] bool, mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = np.zeros((n, n), dtype=bool)
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def children(self, node: int) -> list[int]:
        """Children of `node` (ROOT for the first level) in draft order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root level down to `node` inclusive."""
        path = []
        while node != ROOT:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def best_path(self) -> list[int]:
        """Tokens of the path a best-first drafter rates highest: the first root, then each
        node's first child (drafters emit nodes best first)."""
        path, node = [], ROOT
        while (kids := self.children(node)):
            node = kids[0]
            path.append(self.tokens[node])
        return path

    def walk(self, tokens: Sequence[int]) -> list[int]:
        """The nodes along `tokens` from the first level, as far as the tree follows them."""
        child = {(parent, token): i for i, (parent, token) in enumerate(zip(self.parents,
                                                                             self.tokens))}
        path, node = [], ROOT
        for token in tokens:
            found = child.get((node, token))
            if found is None:
                break
            path.append(node := found)
        return path

    def prefix(self, n: int) -> "DraftTree":
        """The first `n` nodes: a tree, since every node comes after its parent."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def merged(self, other: "DraftTree", max_nodes: int) -> "DraftTree":
        """The union of both trees' paths, at most `max_nodes` nodes: this tree's nodes first
        and in order, then `other`'s that it lacks. Every node follows its parent, so cutting
        at any length leaves a valid tree whose best path starts with this tree's."""
        tokens, parents = list(self.tokens[:max_nodes]), list(self.parents[:max_nodes])
        index = {(parents[i], tokens[i]): i for i in range(len(tokens))}
        mapped: dict[int, int] = {ROOT: ROOT}
        for i, (token, parent) in enumerate(zip(other.tokens, other.parents)):
            if parent not in mapped:  # its parent was cut: so is its whole subtree
                continue
            key = (mapped[parent], token)
            if key not in index:
                if len(tokens) == max_nodes:
                    continue
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
            mapped[i] = index[key]
        return DraftTree(tuple(tokens), tuple(parents))

    def subtree(self, node: int) -> "DraftTree":
        """The descendants of `node`, re-rooted so its children become the first level; node
        order (and so best-first order) is kept."""
        return self.subtree_nodes(node)[0]

    def subtree_nodes(self, node: int) -> tuple["DraftTree", tuple[int, ...]]:
        """subtree(node), and for each of its nodes the index it has in this tree."""
        index = {node: ROOT}
        tokens: list[int] = []
        parents: list[int] = []
        nodes: list[int] = []
        for i in range(node + 1, len(self)):
            if self.parents[i] in index:
                index[i] = len(tokens)
                tokens.append(self.tokens[i])
                parents.append(index[self.parents[i]])
                nodes.append(i)
        return DraftTree(tuple(tokens), tuple(parents)), tuple(nodes)

    def validate(self, vocab_size: int, max_nodes: int, max_depth: int) -> None:
        """Raises InvalidRequest with a message naming the first problem found."""
        if not self.tokens:
            raise InvalidRequest("draft tree is empty: send at least one node")
        self.check_shape(max_nodes)
        for i, token in enumerate(self.tokens):
            if not 0 <= token < vocab_size:
                raise InvalidRequest(f"token id {token} at node {i} is outside [0, {vocab_size})")
        self._check_no_duplicate_siblings()
        depth = int(self.depths().max()) + 1
        if depth > max_depth:
            raise InvalidRequest(f"draft tree is {depth} deep, the limit is {max_depth}")

    def check_shape(self, max_nodes: int) -> None:
        """Raises InvalidRequest unless the tree has at most `max_nodes` nodes, one parent per
        token, and every parent -1 or an earlier node."""
        n = len(self.tokens)
        if n > max_nodes:
            raise InvalidRequest(f"draft tree has {n} nodes, the limit is {max_nodes}")
        if len(self.parents) != n:
            raise InvalidRequest(f"draft tree has {n} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise InvalidRequest(
                    f"parent {parent} of node {i} must be -1 or an earlier node index")

    def _check_no_duplicate_siblings(self) -> None:
        seen: set[tuple[int, int]] = set()
        for i, key in enumerate(zip(self.parents, self.tokens)):
            if key in seen:
                raise InvalidRequest(f"node {i} repeats token {key[1]} under the same parent")
            seen.add(key)
