"""Draft graphs: a draft tree whose repeated subtrees travel once (GSD, Gong et al., ACL 2024,
arXiv 2407.16207, section 3).

Hypotheses that reach the same token usually continue alike, so a drafter that merges them
drafts the continuation once (a node with a second parent, in GSD's terms) and its tree repeats
that subtree under each parent. On the wire the repeat is an alias: a leaf that stands for the
subtree of an earlier node with the same token. The server unrolls the graph back into the tree,
under its node limit.

Unrolling is breadth first, so a tree folds exactly when its nodes are in breadth-first order
(`breadth_first`); `fold` leaves any other tree as it is, and it travels as a plain tree.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.errors import InvalidRequest
from shared.tree import ROOT, DraftTree

MIN_FOLDED = 2  # an alias costs what one node does on the wire: fold subtrees of 2+ nodes


@dataclass(frozen=True)
class DraftGraph:
    """`tree` is the spanning tree as sent; each (node, target) in `aliases` makes leaf `node`
    stand for the subtree below `target`, an earlier node with the same token."""

    tree: DraftTree
    aliases: tuple[tuple[int, int], ...] = ()

    def validate(self, max_nodes: int) -> None:
        """Raises InvalidRequest naming the first problem: the spanning tree's shape and size
        (as sent, before unrolling), then each alias (a later target, a mismatched token, a
        node with children of its own, a cycle)."""
        self.tree.check_shape(max_nodes)
        n = len(self.tree)
        has_children = {p for p in self.tree.parents if p != ROOT}
        seen: set[int] = set()
        for node, target in self.aliases:
            if not 0 <= node < n or node in seen:
                raise InvalidRequest(f"alias node {node} is not a node of the graph, or repeats")
            if not 0 <= target < node:
                raise InvalidRequest(f"alias {node} points to node {target}: an alias must "
                                     "stand for an earlier node")
            if self.tree.tokens[node] != self.tree.tokens[target]:
                raise InvalidRequest(f"alias {node} has token {self.tree.tokens[node]}, its "
                                     f"target {target} token {self.tree.tokens[target]}")
            if node in has_children:
                raise InvalidRequest(f"alias {node} has children of its own")
            seen.add(node)
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        """Kahn's algorithm over tree edges and alias -> target edges: an alias
        whose target reaches the alias again would unroll forever."""
        n = len(self.tree)
        successors: list[list[int]] = [[] for _ in range(n)]
        for i, parent in enumerate(self.tree.parents):
            if parent != ROOT:
                successors[parent].append(i)
        for node, target in self.aliases:
            successors[node].append(target)
        indegree = [0] * n
        for nexts in successors:
            for j in nexts:
                indegree[j] += 1
        ready = [i for i in range(n) if indegree[i] == 0]
        done = 0
        while ready:
            i = ready.pop()
            done += 1
            for j in successors[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    ready.append(j)
        if done < n:
            raise InvalidRequest("draft graph has a cycle: an alias stands for a subtree that "
                                 "contains it")

    def unrolled(self, max_nodes: int) -> DraftTree:
        """The tree the graph stands for, breadth first, cut after `max_nodes` nodes (a valid
        tree: every node follows its parent). A graph without aliases is its tree as sent.
        Call validate first."""
        if not self.aliases:
            return self.tree
        target = dict(self.aliases)
        children = _children(self.tree)
        tokens: list[int] = []
        parents: list[int] = []
        queue = deque((node, ROOT) for node in children[ROOT])
        while queue and len(tokens) < max_nodes:
            node, parent = queue.popleft()
            parents.append(parent)
            tokens.append(self.tree.tokens[node])
            queue.extend((child, len(tokens) - 1) for child in children[target.get(node, node)])
        return DraftTree(tuple(tokens), tuple(parents))


def breadth_first(tree: DraftTree) -> DraftTree:
    """The same tree with its nodes in breadth-first order, siblings kept in draft order (so
    each node's first child stays its best)."""
    children = _children(tree)
    order: list[int] = []
    index = {ROOT: ROOT}
    queue = deque(children[ROOT])
    while queue:
        node = queue.popleft()
        index[node] = len(order)
        order.append(node)
        queue.extend(children[node])
    return DraftTree(tuple(tree.tokens[i] for i in order),
                     tuple(index[tree.parents[i]] for i in order))


def fold(tree: DraftTree) -> DraftGraph:
    """`tree` with every repeat of a subtree of MIN_FOLDED or more nodes made an alias of its
    first occurrence (breadth first). Unrolling gives `tree` back exactly when it is in
    breadth-first order; any other tree is returned as it is, without aliases."""
    if tree != breadth_first(tree):
        return DraftGraph(tree)
    children = _children(tree)
    shapes: dict[tuple, int] = {}  # (token, children's shape ids) -> shape id
    shape, size = [0] * len(tree), [1] * len(tree)
    for node in reversed(range(len(tree))):  # children come after their parents
        key = (tree.tokens[node], tuple(shape[c] for c in children[node]))
        shape[node] = shapes.setdefault(key, len(shapes))
        size[node] += sum(size[c] for c in children[node])
    first: dict[int, int] = {}  # shape id -> its first occurrence in the graph
    tokens: list[int] = []
    parents: list[int] = []
    aliases: list[tuple[int, int]] = []
    queue = deque((node, ROOT) for node in children[ROOT])
    while queue:
        node, parent = queue.popleft()
        parents.append(parent)
        tokens.append(tree.tokens[node])
        here = len(tokens) - 1
        if size[node] >= MIN_FOLDED and shape[node] in first:
            aliases.append((here, first[shape[node]]))
            continue
        first.setdefault(shape[node], here)
        queue.extend((child, here) for child in children[node])
    return DraftGraph(DraftTree(tuple(tokens), tuple(parents)), tuple(aliases))


def _children(tree: DraftTree) -> dict[int, list[int]]:
    """Each node's children in draft order; ROOT's are the first level."""
    children: dict[int, list[int]] = {ROOT: [], **{i: [] for i in range(len(tree))}}
    for i, parent in enumerate(tree.parents):
        children[parent].append(i)
    return children
