"""What the MoA and Falcon drafters share: the trees drafted from their network's rows.

A drafter gives, for a round's context, the first level's top-k (`_sync`) and an `Expand` that
steps a frontier of drafted nodes (`_expander`); how differs (moa.py, falcon.py). From those
this drafts EAGLE-2's dynamic tree (tree_search.py), a designed static tree (static_trees.py)
or a tree sampled from q (draft_trees.sampled_tree), and walks a text down its ranks.
Prompt-lookup nodes and race ranking wrap it (lookup_merge.py, race_aware.py). Knows nothing of
the link or the wire.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Self, Sequence

import numpy as np

from edge_client.drafters.draft_trees import Expand, sampled_tree
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.static_trees import static_tree, walk_ranks
from edge_client.drafters.tree_search import Ranker, TreeSearch, dynamic_tree
from shared.acceptance import AcceptanceMode
from shared.draft_graph import breadth_first
from shared.draft_q import Proposal
from shared.drafter_bundle import BundleError
from shared.drafting.base import DrafterName
from shared.drafting.race import Race
from shared.tree import DraftTree


class TreeDrafter(ABC):
    name: DrafterName  # the drafter its bundle must have been trained for
    # The rule it drafts best for under sampling, measured (results log, `sampling`).
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, graphs: MoaGraphs, search: TreeSearch = TreeSearch()) -> None:
        if graphs.kind is not self.name:
            raise BundleError(f"this drafter bundle is a {graphs.kind} drafter ({graphs.block} "
                              f"token(s) a step): draft with --drafter {graphs.kind}")
        self.graphs = graphs
        self.search = replace(search, branch=min(search.branch, graphs.top_k))
        self.max_depth = search.max_depth
        self.needs_activations = graphs.needs_activations
        self.reset(())

    def sibling(self) -> Self:
        """A drafter like this one over the same sessions (MoaGraphs.sibling), for a
        generation beside this one's."""
        return type(self)(self.graphs.sibling(), self.search)

    def reset(self, prompt: Sequence[int]) -> None:
        """Forgets the text and the activation memory; activations of the prompt come next."""
        self.graphs.reset()

    def follow_race(self, race: Race | None) -> None:
        """Children are ranked by log q; race_aware.py ranks them by the race."""

    def add_activations(self, start: int, activations: np.ndarray) -> None:
        self.graphs.add_activations(start, activations)

    def propose(self, context: Sequence[int], max_nodes: int,
                ranker: Ranker | None = None) -> DraftTree:
        """The designed tree, or EAGLE-2's dynamic tree with children ranked by `ranker`
        where given (else by log q)."""
        if not context or max_nodes < 1 or not self._ready(context):
            return DraftTree((), ())
        first = self._sync(context)  # [top_k] each: the first level
        expand = self._expander(context)
        if self.search.choices is not None:
            tree = static_tree(first, expand, self.search.choices, max_nodes)
        else:
            if ranker is not None:
                ranker.start(context)
            tree = dynamic_tree(first, expand, max_nodes, self.search, self._beam_at, ranker)
        return breadth_first(tree) if self.search.merge else tree

    def propose_sampled(self, context: Sequence[int], max_nodes: int, rng: np.random.Generator
                        ) -> Proposal:
        """Drafts drawn from q = the network's top-k distribution, renormalised
        (`sampled_tree`)."""
        if not context or max_nodes < 1 or not self._ready(context):
            return Proposal(DraftTree((), ()))
        return sampled_tree(self._sync(context), self._expander(context), max_nodes,
                            self.search.max_depth, self.search.beam, rng)

    def ranks_along(self, context: Sequence[int], truth: Sequence[int]) -> list[int]:
        """The rank of each token of `truth` (the target's text after `context`) among the
        drafter's top-k down its path (static_trees.walk_ranks)."""
        if not self._ready(context):
            return []
        ids = self._sync(context)[1]
        return walk_ranks(ids, self._expander(context), truth, self.search.max_depth)

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Nothing to learn: committed tokens reach the cache at the next propose, and their
        activations through `add_activations`."""

    def _ready(self, context: Sequence[int]) -> bool:
        """Whether the drafter can draft after `context` (its memory brought up to it)."""
        return self.graphs.ready(context)

    def _beam_at(self, depth: int) -> int:
        """How many nodes at `depth` (0: the first level) may be expanded."""
        return self.search.beam

    @abstractmethod
    def _sync(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Brings the cached text to `context`; the first level's top log q and ids."""

    @abstractmethod
    def _expander(self, context: Sequence[int]) -> Expand:
        """One round's `Expand` after `_sync(context)`."""
