"""The edge's side of a server-paced session: which of its drafts the server may still use.

The server re-roots the edge's freshest draft at its own committed position before every
forward (shared/rerooting.py). So while the last draft sent still continues the committed text,
a new one would only repeat it, and the edge just acknowledges the Verdict; once a forward used
the draft, or the text left it, the edge drafts again from the newest position.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot
from shared.tree import DraftTree


class DraftFollower:
    """Draft ids and the live draft of one Decode stream (ids start again on a new stream)."""

    def __init__(self) -> None:
        self._next_id = 1
        self._live: DraftRequest | None = None

    def sent(self, draft: DraftRequest) -> DraftRequest:
        """`draft` numbered for sending; a draft with nodes becomes the live one."""
        draft = replace(draft, round_id=self._next_id)
        self._next_id += 1
        if len(draft.tree):
            self._live = draft
        return draft

    def continues(self, context: Sequence[int]) -> bool:
        """True while the live draft still has nodes past `context`."""
        live = self._live
        return live is not None and reroot(live.tree, live.base_length, context) is not None

    def verified(self, verdict: Verdict, context: Sequence[int]) -> DraftTree | None:
        """The live draft as the server verified it in `verdict` (re-rooted at `context`, the
        committed text before it), or None when the forward used none of the edge's nodes. A
        used draft is spent: what it did not get accepted can never continue the text."""
        live = self._live
        if live is None or verdict.draft_id != live.round_id:
            return None
        self._live = None
        rerooted = reroot(live.tree, live.base_length, context)
        return None if rerooted is None else rerooted.proposal.tree
