"""Draft trees of a fixed shape, designed for the drafter: Falcon's Custom-Designed Decoding Tree
(Gao et al., AAAI 2025, arXiv 2412.12639, section 3.3), as Medusa's and EAGLE-1's static trees.

A shape is a list of choices, each a path of ranks from the root: (0, 1) is the drafter's
second-best child of its best first token. Falcon ships shapes hand-tuned for Vicuna; here the
shape is designed from the drafter's own measured accuracy instead, as Medusa builds its tree
(Cai et al., arXiv 2401.10774, section 3.3.1): `hits[d, r]`, how often the target's token at
depth d + 1 was the drafter's r-th given the path above was right, makes a path's expected
acceptance the product of its ranks' hits, and the tree keeps the `max_nodes` paths with the
most. Against EAGLE-2's dynamic tree (draft_trees.best_tree) it spends no drafting on nodes it
will not send, but cannot follow a round's own confidence. numpy only.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from edge_client.drafters.draft_trees import Candidates, Expand
from edge_client.drafters.drafter_wrapper import DrafterWrapper, PooledDrafter
from shared.draft_q import Proposal
from shared.drafter_bundle import CHOICES_FILE
from shared.tree import ROOT, DraftTree

Choice = tuple[int, ...]


def static_tree(first: tuple[np.ndarray, np.ndarray], expand: Expand,
                choices: Sequence[Choice], max_nodes: int) -> DraftTree:
    """The tree of the first `max_nodes` `choices` (prefix-closed, shorter first, as `design`
    writes them): `first` is the first level's top log q and ids, `expand` gives the children
    rows of each node that has children, a level at a time (TreeDrafter._expander)."""
    kept = list(choices[:max_nodes])
    nodes = Candidates()
    index: dict[Choice, int] = {(): ROOT}
    rows = {ROOT: first}
    for depth in range(max((len(c) for c in kept), default=0)):
        level = [c for c in kept if len(c) == depth + 1 and c[:-1] in index]
        parents = sorted({index[c[:-1]] for c in level} - {ROOT})
        if parents:
            logprobs, ids = expand(nodes, parents)
            rows.update({node: (logprobs[i], ids[i]) for i, node in enumerate(parents)})
        for choice in level:
            parent = index[choice[:-1]]
            logprobs, ids = rows[parent]
            if choice[-1] < len(ids):
                score = 0.0 if parent == ROOT else nodes.scores[parent]
                nodes.add(int(ids[choice[-1]]), parent, score + float(logprobs[choice[-1]]), depth)
                index[choice] = len(nodes.tokens) - 1
    return DraftTree(tuple(nodes.tokens), tuple(nodes.parents))


class Walkable(PooledDrafter, Protocol):
    """A tree drafter that can walk a text down its ranks (tree_drafter.TreeDrafter)."""

    def ranks_along(self, context: Sequence[int], truth: Sequence[int]) -> list[int]: ...


class RankWalker(DrafterWrapper[Walkable]):
    """A tree drafter in process (moa.py, falcon.py) that, before each round's tree, walks the
    target's text `text` (prompt and greedy answer) down its ranks (`walk_ranks`): `walks`,
    what `rank_hits` counts. Greedy only."""

    def __init__(self, drafter: Walkable, text: Sequence[int]) -> None:
        super().__init__(drafter)
        self.text = list(text)
        self.walks: list[list[int]] = []

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        if len(context) < len(self.text):
            self.walks.append(self.drafter.ranks_along(context, self.text[len(context):]))
        return self.drafter.propose(context, max_nodes)

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        raise NotImplementedError("the calibration decodes greedily")


def walk_ranks(ids: np.ndarray, expand: Expand, truth: Sequence[int], max_depth: int
               ) -> list[int]:
    """The rank of each token of `truth` among the drafter's top-k at its depth, `ids` [top_k]
    the first level's, down the path while it stays among them (-1 where it fell outside):
    what a static tree is designed from."""
    nodes, ranks = Candidates(), []
    for depth, token in enumerate(truth[:max_depth]):
        hit = np.flatnonzero(ids == token)
        ranks.append(int(hit[0]) if hit.size else -1)
        if not hit.size or depth + 1 == max_depth:
            break
        nodes.add(int(token), len(nodes.tokens) - 1 if depth else ROOT, 0.0, depth)
        ids = expand(nodes, [len(nodes.tokens) - 1])[1][0]
    return ranks


def rank_hits(walks: Sequence[Sequence[int]], depth: int, top_k: int) -> np.ndarray:
    """hits [depth, top_k] from walks down the target's text (`walk_ranks`: the rank
    of each token among the drafter's top-k, -1 where it fell outside and the walk ended)."""
    counts = np.zeros((depth, top_k + 1))
    for walk in walks:
        for d, rank in enumerate(walk[:depth]):
            counts[d, rank if rank >= 0 else top_k] += 1
    reached = counts.sum(axis=1, keepdims=True)
    return np.divide(counts[:, :top_k], reached, out=np.zeros((depth, top_k)),
                     where=reached > 0)


def design(hits: np.ndarray, max_nodes: int) -> tuple[Choice, ...]:
    """The `max_nodes` paths of most expected acceptance, best first by a heap over the paths'
    products (a child never beats its parent, so the set is prefix-closed); written shorter
    first, as static_tree reads them."""
    depth, top_k = hits.shape
    frontier: list[tuple[float, Choice]] = [(-float(hits[0, r]), (r,)) for r in range(top_k)
                                            if hits[0, r] > 0]
    heapq.heapify(frontier)
    chosen: list[Choice] = []
    while frontier and len(chosen) < max_nodes:
        negative, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r in range(top_k):
                if hits[len(path), r] > 0:
                    heapq.heappush(frontier,
                                   (negative * float(hits[len(path), r]), (*path, r)))
    return tuple(sorted(chosen, key=lambda c: (len(c), c)))


def save(directory: Path, choices: Sequence[Choice], hits: np.ndarray, walks: int) -> Path:
    path = directory / CHOICES_FILE
    path.write_text(json.dumps({"choices": [list(c) for c in choices], "walks": walks,
                                "hits": np.round(hits, 4).tolist()}) + "\n")
    return path


def load(directory: Path) -> tuple[Choice, ...]:
    """The shape `save` wrote in `directory`; FileNotFoundError names the file where none is."""
    path = directory / CHOICES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no designed tree; design one first "
                                "(python -m benchmarks.drafter_ablation designs its Falcon "
                                "variants)")
    return tuple(tuple(c) for c in json.loads(path.read_text())["choices"])
