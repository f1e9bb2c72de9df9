"""The edge follows the server's pace (Verdict.next). Told to draft, it drafts unless its last
draft still continues the text (the server re-roots it: shared/rerooting.py); told to rest, it
acknowledges once per quarter of the lead. It counts what became of each draft.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from edge_client.reporting import DraftOutcomes
from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot
from shared.tree import DraftTree

# A resting edge acknowledges once per this share of the server's lead: often enough that the
# lead never stops the server, seldom enough that answers do not cost the server's core
ACKS_PER_LEAD = 4


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
        """The live draft as `verdict` verified it, re-rooted at `context` (the text before
        it); None when the forward used none of its nodes. A used draft is spent."""
        live = self._live
        if live is None or verdict.draft_id != live.round_id:
            return None
        self._live = None
        self.outcomes.used += 1
        self.outcomes.earned += bool(verdict.accepted_nodes)
        rerooted = reroot(live.tree, live.base_length, context)
        return None if rerooted is None else rerooted.proposal.tree
