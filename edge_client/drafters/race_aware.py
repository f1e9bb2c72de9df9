"""Race-aware drafting around a tree drafter (ERSD, Kobus and Gunduz 2025, arXiv 2504.15475).

Under exponential-race, a node's children are ranked by how likely the session's race picks
each, from log q and the race's noise, weighed as the session's committed text says
(shared/drafting/race.py), instead of by log q. What the ranker learnt in one session carries
over to the next at the same temperature.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from edge_client.drafters.drafter_wrapper import DrafterWrapper, PooledDrafter
from edge_client.drafters.tree_search import Ranker
from shared.drafting.race import Race, RaceRanker
from shared.tree import DraftTree


class Ranked(PooledDrafter, Protocol):
    """A drafter whose children a caller may rank (tree_drafter.TreeDrafter)."""

    def sibling(self) -> "Ranked": ...

    def propose(self, context: Sequence[int], max_nodes: int,
                ranker: Ranker | None = None) -> DraftTree:
        """As Drafter.propose, a node's children ranked by `ranker` where given."""


class RaceAware(DrafterWrapper[Ranked]):
    def __init__(self, drafter: Ranked, vocab: int) -> None:
        super().__init__(drafter)
        self.vocab = vocab  # the vocabulary the race draws its noise over
        self._race: RaceRanker | None = None  # this session's, under exponential-race
        self.ranker: RaceRanker | None = None  # the last one: its fit carries over

    def sibling(self) -> "RaceAware":
        return RaceAware(self.drafter.sibling(), self.vocab)

    def follow_race(self, race: Race | None) -> None:
        self._race = None
        if race is not None:
            self.ranker = (self.ranker.follow(race) if self.ranker is not None
                           else RaceRanker(race, self.vocab))
            self._race = self.ranker

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        return self.drafter.propose(context, max_nodes, self._race)
