"""How a trained drafter searches its tree (`TreeSearch`), and EAGLE-2's dynamic tree.

EAGLE-2 (Li et al., arXiv 2406.16858, section 4): expand the `beam` nodes of the newest depth
with the highest cumulative draft log-probability, each proposing its top `branch` children,
then keep the best `max_nodes` overall, best first. With `merge`, nodes of one depth with the
same token are drafted once (GSD's draft graph, shared/draft_graph.py) and the tree, breadth
first, repeats the subtree under each; the wire sends it once. A `Ranker` may rank a node's
children instead of log q (race_aware.py). Knows nothing of the network: its rows come from an
`Expand` (draft_trees.py). Numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from edge_client.drafters.draft_trees import Candidates, Expand, best_graph, best_tree
from edge_client.drafters.static_trees import Choice
from shared.tree import ROOT, DraftTree


@dataclass(frozen=True)
class TreeSearch:
    max_depth: int = 8  # the deepest tree drafted
    beam: int = 8  # nodes of a depth expanded
    branch: int = 8  # children per expanded node, at most the step graph's top-k
    merge: bool = False  # GSD: draft graphs, sent breadth first
    choices: tuple[Choice, ...] | None = None  # a designed static shape (static_trees.py)


class Ranker(Protocol):
    """Ranks a node's candidate children by something other than log q (race.RaceRanker)."""

    def start(self, context: Sequence[int]) -> None:
        """A round drafts from `context`."""

    def scores(self, logprobs: np.ndarray, ids: np.ndarray, path: Sequence[int]) -> np.ndarray:
        """log q [k] of the candidates `ids` [k] under the node `path` -> their scores [k]."""


def dynamic_tree(first: tuple[np.ndarray, np.ndarray], expand: Expand, max_nodes: int,
                 search: TreeSearch, beam_at: Callable[[int], int],
                 ranker: Ranker | None) -> DraftTree:
    """EAGLE-2's tree of at most `max_nodes` nodes from `first`, the root's top log q and ids
    ([top_k] each); `beam_at(depth)` is how many nodes at `depth` may be expanded."""
    nodes = Candidates()
    for score, token in _children(*first, nodes, ROOT, search.branch, ranker):
        nodes.add(token, ROOT, score, 0)
    for depth in range(search.max_depth - 1):
        frontier = _frontier(nodes, depth, max_nodes, beam_at(depth))
        if not frontier:
            break
        top_logprobs, top_ids = expand(nodes, frontier)  # [len(frontier), top_k] each
        for row, node in enumerate(frontier):
            for score, token in _children(top_logprobs[row], top_ids[row], nodes, node,
                                          search.branch, ranker):
                nodes.add(token, node, nodes.scores[node] + score, depth + 1)
        if search.merge:
            nodes.merge(depth + 1)
    return best_graph(nodes, max_nodes) if nodes.aliases else best_tree(nodes, max_nodes)


def _children(logprobs: np.ndarray, ids: np.ndarray, nodes: Candidates, parent: int,
              branch: int, ranker: Ranker | None) -> list[tuple[float, int]]:
    """The `branch` children (score, token) of `parent` (ROOT: the round's context) from its
    top-k: by log q, or by the ranker's scores."""
    if ranker is None:
        return [(float(s), int(t)) for s, t in zip(logprobs[:branch], ids[:branch])]
    path = () if parent == ROOT else nodes.path(parent)
    scores = ranker.scores(logprobs, ids, path)
    best = np.argsort(-scores)[:branch]
    return [(float(scores[i]), int(ids[i])) for i in best]


def _frontier(nodes: Candidates, depth: int, max_nodes: int, beam: int) -> list[int]:
    """The best `beam` nodes at `depth`, if any of their children could still make the final
    cut (scores only fall along a path, so below the max_nodes-th score none can)."""
    at_depth = [i for i, d in enumerate(nodes.depths) if d == depth]
    at_depth.sort(key=lambda i: -nodes.scores[i])
    cutoff = sorted(nodes.scores, reverse=True)[min(max_nodes, len(nodes.scores)) - 1]
    return [i for i in at_depth[:beam] if i not in nodes.aliases
            and (nodes.scores[i] >= cutoff or len(nodes.scores) < max_nodes)]
