"""The drafter interface: propose a tree from the committed text, then learn from the verdict.

Same two-method shape as transformers' candidate generators (get_candidates /
update_candidate_strategy), DESIGN section 3.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from shared.tree import DraftTree


class Drafter(Protocol):
    name: str

    def reset(self, prompt: Sequence[int]) -> None:
        """Starts a new generation whose committed text is `prompt`."""

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        """A tree of at most `max_nodes` nodes continuing `context` (the committed ids).
        May be empty when the drafter has nothing to offer."""

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Learns from a verdict: `context` is the committed ids before the round, `tokens` the
        ids the round committed (accepted drafts then the target's own token)."""
