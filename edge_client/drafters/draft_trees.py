"""The candidates a tree drafter expands in one round, and the trees it sends from them.

`Candidates` records every node drafted (token, parent, cumulative log q, depth, K/V row,
merged aliases); `best_tree` and `best_graph` cut the best of them to the budget (EAGLE-2's
reranking, Li et al., arXiv 2406.16858, section 4; GSD's draft graphs, arXiv 2407.16207), and
`sampled_tree` draws a tree from q for the sampled-drafts rule. Shared by the MoA and Falcon
drafters (moa.py, falcon.py); numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from shared.draft_graph import DraftGraph
from shared.draft_q import NodeQ, Proposal
from shared.drafting.trie import SAMPLED_WIDTHS
from shared.tree import ROOT, DraftTree


@dataclass
class Candidates:
    """Every node drafted this round, in the order drafted."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative log q from the root
    depths: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # row in the round's K/V, -1 if not expanded
    aliases: dict[int, int] = field(default_factory=dict)  # merged node -> the node it joined

    def add(self, token: int, parent: int, score: float, depth: int) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(depth)
        self.slots.append(-1)

    def merge(self, depth: int) -> None:
        """GSD (Gong et al., arXiv 2407.16207, section 3): the nodes at `depth` that repeat a
        token join the best-scoring node with it; only that one is expanded, and its subtree
        stands for theirs."""
        best: dict[int, int] = {}
        for node in sorted((i for i, d in enumerate(self.depths) if d == depth),
                           key=lambda i: -self.scores[i]):
            joined = best.setdefault(self.tokens[node], node)
            if joined != node:
                self.aliases[node] = joined

    def path(self, node: int) -> tuple[int, ...]:
        """The tokens from the root to `node`, both ends included."""
        return tuple(self.tokens[a] for a in reversed(self.ancestors(node))) + (
            self.tokens[node],)

    def ancestors(self, node: int) -> list[int]:
        chain = []
        while (node := self.parents[node]) != ROOT:
            chain.append(node)
        return chain


# frontier nodes -> their top children: log q [len(frontier), k] and token ids [len(frontier), k]
Expand = Callable[[Candidates, list[int]], tuple[np.ndarray, np.ndarray]]


def sampled_tree(first: tuple[np.ndarray, np.ndarray], expand: Expand, max_nodes: int,
                 max_depth: int, beam: int, rng: np.random.Generator,
                 widths: tuple[int, int] = SAMPLED_WIDTHS
                 ) -> Proposal:
    """A tree whose children are draws from q, for acceptance sampled-drafts, and those q.

    `first` is the root's top-k (log q, ids); q at a node is its top-k renormalised in
    float32, as the wire carries it. Level by level, the `beam` nodes of the newest depth
    with the highest path probability are expanded (EAGLE-2's dynamic tree), each drawing
    its children at once without replacement (Gumbel top-k), as many as `widths` and the
    budget left allow. That count is fixed before the node draws, never by what it draws:
    the condition under which recursive rejection sampling over these children stays
    exact (SpecInfer section 4.3), as in TokenTrie.sampled_tree."""
    nodes, qs = Candidates(), []

    def draw(parent: int, logprobs: np.ndarray, ids: np.ndarray, width: int) -> None:
        q = np.exp(logprobs - logprobs.max())
        q = (q / q.sum()).astype(np.float32)  # [k]
        qs.append(NodeQ(parent, tuple(int(t) for t in ids), tuple(map(float, q))))
        with np.errstate(divide="ignore"):  # -inf keys where q = 0: never drawn
            keys = np.log(q.astype(np.float64)) + rng.gumbel(size=len(q))  # [k]
        score = 0.0 if parent == ROOT else nodes.scores[parent]
        depth = 0 if parent == ROOT else nodes.depths[parent] + 1
        for j in np.argsort(-keys)[:min(width, int((q > 0).sum()))]:
            nodes.add(int(ids[j]), parent, score + float(np.log(q[j])), depth)

    draw(ROOT, *first, min(widths[0], max_nodes))
    for depth in range(max_depth - 1):
        newest = sorted((i for i, d in enumerate(nodes.depths) if d == depth),
                        key=lambda i: -nodes.scores[i])[:beam]
        plan, room = [], max_nodes - len(nodes.tokens)
        for node in newest:
            if room == 0:
                break
            plan.append((node, min(widths[1], room)))
            room -= plan[-1][1]
        if not plan:
            break
        top_logprobs, top_ids = expand(nodes, [node for node, _ in plan])
        for row, (node, width) in enumerate(plan):
            draw(node, top_logprobs[row], top_ids[row], width)
    return Proposal(DraftTree(tuple(nodes.tokens), tuple(nodes.parents)), tuple(qs))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    keep, limit = 0, min(len(a), len(b))
    while keep < limit and a[keep] == b[keep]:
        keep += 1
    return keep


def best_tree(nodes: Candidates, max_nodes: int) -> DraftTree:
    """The `max_nodes` best nodes by cumulative log q, best first. A child never scores above
    its parent and ties go to the shallower node, so the set is closed under ancestors and
    every parent precedes its children."""
    return _graph(nodes, _ranked(nodes)[:max_nodes]).tree


def best_graph(nodes: Candidates, max_nodes: int) -> DraftTree:
    """The unrolled tree of the most best nodes whose graph unrolls to at most `max_nodes`
    nodes (each merged node repeats the subtree it joined; one more node never shrinks the
    unrolled tree, so a bisection finds the count)."""
    order = _ranked(nodes)
    low, high = 1, min(max_nodes, len(order))
    while low < high:
        mid = (low + high + 1) // 2
        if len(_graph(nodes, order[:mid]).unrolled(max_nodes + 1)) <= max_nodes:
            low = mid
        else:
            high = mid - 1
    return _graph(nodes, order[:low]).unrolled(max_nodes)


def _ranked(nodes: Candidates) -> list[int]:
    """Best first; a merged node right after the node it joined at equal score (it never
    scores above it), so any leading run keeps each alias's target before it."""
    return sorted(range(len(nodes.tokens)),
                  key=lambda i: (-nodes.scores[i], nodes.depths[i], i in nodes.aliases))


def _graph(nodes: Candidates, keep: list[int]) -> DraftGraph:
    """The nodes `keep` (a leading run of `_ranked`) as a graph in that order."""
    index = {node: i for i, node in enumerate(keep)}
    tree = DraftTree(tuple(nodes.tokens[i] for i in keep),
                     tuple(ROOT if nodes.parents[i] == ROOT else index[nodes.parents[i]]
                           for i in keep))
    return DraftGraph(tree, tuple((index[node], index[joined])
                                  for node, joined in nodes.aliases.items() if node in index))
