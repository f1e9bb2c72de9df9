"""The edge's side of a paced session: the server owns the pace (Verdict.next), and the edge
follows. Told to draft, it drafts unless its last draft still continues the committed text (the
server re-roots it, shared/rerooting.py), and then only acknowledges; told to rest, it drafts
nothing and acknowledges once per quarter of the lead. What became of each draft is counted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot
from shared.tree import DraftTree

# A resting edge acknowledges once per this share of the server's lead: often enough that the
# lead never stops the server, seldom enough that answers do not cost the server's core
ACKS_PER_LEAD = 4


@dataclass
class DraftOutcomes:
    """What became of the drafts a paced generation sent, as the edge learns it: verified by a
    forward (`used`; `earned` of them got a node accepted), passed by the server before any
    forward could use them though its text followed them as far as it went (`late`: on time,
    each would have offered right tokens), or left by the text at their first token (`wrong`).
    A draft still live when the generation ends or its stream breaks is none of these. On a
    slow link `late` is what the round trip costs; `wrong` is the drafter's."""

    used: int = 0
    earned: int = 0
    late: int = 0
    wrong: int = 0

    @property
    def settled(self) -> int:
        return self.used + self.late + self.wrong


class DraftFollower:
    """Draft ids and the live draft of one Decode stream (ids start again on a new stream),
    and what became of each draft (`outcomes`, kept across the generation's streams)."""

    def __init__(self, outcomes: DraftOutcomes | None = None) -> None:
        self.outcomes = outcomes or DraftOutcomes()
        self._next_id = 1
        self._live: DraftRequest | None = None
        self._last_sent: DraftRequest | None = None

    def sent(self, draft: DraftRequest) -> DraftRequest:
        """`draft` numbered for sending; a draft with nodes becomes the live one."""
        draft = replace(draft, round_id=self._next_id)
        self._next_id += 1
        if len(draft.tree):
            self._live = draft
        self._last_sent = draft
        return draft

    @property
    def last_base(self) -> int:
        """The committed length the edge last answered (0: none yet)."""
        return 0 if self._last_sent is None else self._last_sent.base_length

    def needless(self, ack: DraftRequest, lead: int) -> bool:
        """True when `ack`, an acknowledgement while the server said rest, need not go: it
        tells nothing new of the rows and the server is far from its `lead`. Each answer
        costs the server's event loop a read on the core its forwards run on (results log,
        `latency_verdict_first`)."""
        last = self._last_sent
        return (last is not None and lead > 0 and ack.rows_held == last.rows_held
                and ack.base_length - last.base_length < lead // ACKS_PER_LEAD)

    def due(self, context: Sequence[int]) -> bool:
        """True when a new draft is due: the live one no longer has nodes past `context`."""
        live = self._live
        if live is None:
            return True
        if reroot(live.tree, live.base_length, context) is not None:
            return False
        if live.tree.walk(context[live.base_length:]):  # right, but passed before it was used
            self.outcomes.late += 1
        else:
            self.outcomes.wrong += 1
        self._live = None
        return True

    def verified(self, verdict: Verdict, context: Sequence[int]) -> DraftTree | None:
        """The live draft as the server verified it in `verdict` (re-rooted at `context`, the
        committed text before it), or None when the forward used none of the edge's nodes. A
        used draft is spent: what it did not get accepted can never continue the text."""
        live = self._live
        if live is None or verdict.draft_id != live.round_id:
            return None
        self._live = None
        self.outcomes.used += 1
        self.outcomes.earned += bool(verdict.accepted_nodes)
        rerooted = reroot(live.tree, live.base_length, context)
        return None if rerooted is None else rerooted.proposal.tree
