"""Prompt-lookup nodes merged into another drafter's trees.

Copying is what a small drafter predicts worst and n-gram lookup best (REST, He et al., arXiv
2311.08252, makes the same case for retrieval): when the text repeats itself, a prompt-lookup
tree (shared/drafting/pld.py) of up to `nodes` nodes, a quarter of the budget at most, is
merged into the drafter's tree, which is drafted with the rest. Sampled trees go without:
lookup nodes are not drawn from q.
"""
from __future__ import annotations

from typing import Sequence

from edge_client.drafters.drafter_wrapper import DrafterWrapper, PooledDrafter
from shared.draft_graph import breadth_first
from shared.drafting.pld import LOOKUP_NODES, PromptLookupDrafter, with_lookup
from shared.tree import DraftTree


class LookupMerge(DrafterWrapper[PooledDrafter]):
    def __init__(self, drafter: PooledDrafter, nodes: int = LOOKUP_NODES,
                 graphs: bool = False) -> None:
        """`graphs`: the drafter drafts GSD draft graphs, so the merged tree stays breadth
        first, the order in which the wire folds them (shared/draft_graph.py)."""
        super().__init__(drafter)
        self.nodes, self.graphs = nodes, graphs
        self._lookup = PromptLookupDrafter()

    def sibling(self) -> "LookupMerge":
        return LookupMerge(self.drafter.sibling(), self.nodes, self.graphs)

    def reset(self, prompt: Sequence[int]) -> None:
        self._lookup.reset(prompt)
        self.drafter.reset(prompt)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        tree = with_lookup(self._lookup, context, max_nodes, self.nodes,
                           lambda room: self.drafter.propose(context, room))
        return breadth_first(tree) if self.graphs else tree
