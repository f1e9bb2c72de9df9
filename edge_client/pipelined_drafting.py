"""Pipelined drafting: draft round r+1 while round r is in flight (docs/architecture.md, Pacing).

The guess is that the server accepts the sent tree's best path and then picks one of the
drafter's candidates for the token after it. The next tree is drafted from there: its first
level holds those candidates, and the subtree under the one the server picked is the next round's
tree, ready when the Verdict lands. Any other outcome throws the guess away.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from shared.drafting.base import Drafter
from shared.tree import ROOT, DraftTree


@dataclass(frozen=True)
class Speculation:
    path: tuple[int, ...]  # the sent tree's best path, assumed accepted
    tree: DraftTree  # drafted after it; its first level guesses the target's own token
    spent_s: float  # drafting time, spent while the round was in flight

    @classmethod
    def draft(cls, drafter: Drafter, context: Sequence[int], sent: DraftTree,
              max_nodes: int) -> "Speculation | None":
        start = time.perf_counter()
        path = sent.best_path()
        if not path:
            return None
        tree = drafter.propose([*context, *path], max_nodes + 1)
        return cls(tuple(path), tree, time.perf_counter() - start)

    def next_tree(self, committed: Sequence[int]) -> DraftTree | None:
        """The ready tree for the next round when the round committed `path` + one token the
        guess holds; None otherwise."""
        if tuple(committed[:-1]) != self.path:
            return None
        for node in self.tree.children(ROOT):
            if self.tree.tokens[node] == committed[-1]:
                return self.tree.subtree(node) or None
        return None
