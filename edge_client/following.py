"""The edge's side of a server-paced session: which of its drafts the server may still use, and
how far ahead the next one must reach.

The server re-roots the edge's freshest draft at its own committed position before every
forward (shared/rerooting.py). So while the last draft sent still continues the committed text,
a new one would only repeat it, and the edge just acknowledges the Verdict; once a forward used
the draft, or the text left it, the edge drafts again from the newest position.

A draft travels while the server goes on committing: by the time a forward uses it, the server
has committed `lag` tokens past the draft's base (the link's delay times the server's token
rate, measured here as their product from the drafts the server used). Only the draft's nodes
below those tokens can be verified, so the edge drafts a second tree past the `lag` tokens it
expects and hangs it below them (`drafted_ahead`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from edge_client.offline import draft_offline
from shared.drafting.base import Drafter
from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot
from shared.tree import DraftTree

LAG_MEMORY = 0.7  # weight of the past in the lag's running mean: about the last 3 drafts count


class Lag:
    """Tokens the server commits past a draft's base before a forward can use the draft."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed
        self._mean = 0.0

    def observe(self, tokens: int) -> None:
        self._mean = LAG_MEMORY * self._mean + (1 - LAG_MEMORY) * tokens

    @property
    def mean(self) -> float:
        return self._mean

    def ahead(self) -> int:
        """How many tokens the next draft should reach past before its tree begins."""
        return self.fixed if self.fixed is not None else int(self._mean + 0.5)


class DraftFollower:
    """Draft ids and the live draft of one Decode stream (ids start again on a new stream)."""

    def __init__(self, lag: Lag) -> None:
        self.lag = lag
        self._next_id = 1
        self._live: DraftRequest | None = None

    def sent(self, draft: DraftRequest) -> DraftRequest:
        """`draft` numbered for sending; a draft with nodes becomes the live one."""
        draft = replace(draft, round_id=self._next_id)
        self._next_id += 1
        if len(draft.tree):
            self._live = draft
        return draft

    def due(self, context: Sequence[int]) -> bool:
        """True when a new draft is due: the live one no longer has nodes past `context`. A
        live draft the server overtook before using it (right as far as it reached) tells the
        lag it was at least that deep."""
        live = self._live
        if live is None:
            return True
        if reroot(live.tree, live.base_length, context) is not None:
            return False
        since = context[live.base_length:]
        path = live.tree.walk(since)
        if path and not live.tree.children(path[-1]):  # right down to a leaf, and overtaken
            self.lag.observe(len(since))
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
        self.lag.observe(len(context) - live.base_length)
        rerooted = reroot(live.tree, live.base_length, context)
        return None if rerooted is None else rerooted.proposal.tree


def drafted_ahead(drafter: Drafter, context: Sequence[int], nodes: int, ahead: int,
                  max_nodes: int, max_depth: int) -> DraftTree:
    """The drafter's tree at `context`, merged with a second tree that starts `ahead` tokens
    further on: drafted past the first tree's best path (the tokens the server is expected to
    commit while the draft travels) and hung below it. Whichever of the two the server's text
    follows, the part below its committed position is verified. At most `max_nodes` nodes and
    `max_depth` levels, the server's limits."""
    near = drafter.propose(context, nodes)
    ahead = min(ahead, max_depth - drafter.max_depth)
    if ahead <= 0:
        return near
    spine = near.best_path()[:ahead]
    spine += draft_offline(drafter, [*context, *spine], ahead - len(spine))
    if len(spine) < ahead:  # the drafter sees nothing that far
        return near
    far = drafter.propose([*context, *spine], nodes)
    return near.merged(far.below(spine), max_nodes)
