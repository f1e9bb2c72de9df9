"""The drafter interface: propose a tree from the committed text, then learn from the verdict.

Same two-method shape as transformers' candidate generators (get_candidates /
update_candidate_strategy), docs/architecture.md, Drafters. Reading the server half's
activations is a capability of its own (`ReadsActivations`), as a candidate generator that
needs more than the text (the assistant model's) keeps it to itself.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Protocol, Sequence, TypeGuard, runtime_checkable

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.drafting.race import Race
from shared.tree import DraftTree


class DrafterName(StrEnum):
    """Drafters by name, as the CLIs and the wire spell them. A StrEnum: parsed once where text
    comes in (DrafterName("pld") raises ValueError on anything else), equal to its value."""

    AUTO = "auto"  # the edge's choice: MOA when the server offers it, else PLD
    MOA = "moa"  # the trained drafter (edge_client/drafters/moa.py)
    FALCON = "falcon"  # the trained semi-autoregressive drafter (edge_client/drafters/falcon.py)
    PLD = "pld"
    ADED = "aded"
    # Token Recycling, the server's own only: it drafts from the target's logits, which the
    # edge never sees (cloud_server/decoding/recycling.py)
    RECYCLE = "recycle"


class Drafter(Protocol):
    name: DrafterName
    sampling_acceptance: AcceptanceMode  # the rule used when sampling and none was asked for
    max_depth: int  # the deepest tree it drafts

    def reset(self, prompt: Sequence[int]) -> None:
        """Starts a new generation whose committed text is `prompt`."""

    def follow_race(self, race: Race | None) -> None:
        """Under acceptance exponential-race, the session's race (None otherwise): a drafter
        that can names the race's likely winners first (race.py); the others ignore it."""

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        """A tree of at most `max_nodes` nodes continuing `context` (the committed ids).
        May be empty when the drafter has nothing to offer."""

    def propose_sampled(self, context: Sequence[int], max_nodes: int, rng: np.random.Generator
                        ) -> Proposal:
        """For acceptance sampled-drafts: a tree whose children were drawn from q without
        replacement, and for every node with children the q they were drawn from."""

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Learns from a verdict: `context` is the committed ids before the round, `tokens` the
        ids the round committed (accepted drafts then the target's own token)."""


@runtime_checkable
class ReadsActivations(Protocol):
    """A drafter that also reads the server half's activations (MoA, Falcon): the session then
    asks for them, and every Verdict's rows go to add_activations."""

    # False for a bundle whose memory is the text's own tokens (the Independent baseline)
    needs_activations: bool

    def add_activations(self, start: int, values: np.ndarray) -> None:
        """The server half's rows for verified positions start, start + 1, ...:
        values [rows, width]."""


def reads_activations(drafter: object) -> TypeGuard[ReadsActivations]:
    """Whether `drafter` (None: no drafter) wants the server half's activations."""
    return isinstance(drafter, ReadsActivations) and drafter.needs_activations


class TextDrafter:
    """What a drafter that reads only the text has in common."""

    name: DrafterName
    sampling_acceptance: AcceptanceMode
    max_depth: int

    def follow_race(self, race: Race | None) -> None:
        """Its trees come from the text alone: the same under every rule."""
