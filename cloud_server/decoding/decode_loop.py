"""The server's one decode loop: forward after forward until the generation ends, each verifying
the client's freshest draft (if any) with the server's own candidates, each Verdict sent
(docs/architecture.md, "Pacing").

Every way the server decodes is this loop with a different pace rule (pacing.py) and forward
builder (forward_builder.py): lock-step is Lockstep with no candidates of its own; server pace
is ServerPace; auto pace is AutoPace; server-side generation (Generate) and a session going on
after its stream broke are the base PaceRule over an inbox nobody fills. Flow control keeps
the server at most `lead` tokens past what the client acknowledged. Runs on the event loop;
knows nothing of gRPC or of the model: the caller hands it a forward and a send.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Awaitable, Callable, Protocol, Sequence

from cloud_server.decoding.pacing import PaceRule
from cloud_server.rpc.stream_buffers import Inbox
from shared.messages import DraftRequest, Next, Verdict


@dataclass(frozen=True)
class Forwarded:
    """A forward's Verdict, and the tokens the server's own candidates alone would have
    committed in it (None: unknown, a client draft verified alone), which AutoPace sets
    against what the forward committed to learn what a client draft adds."""

    verdict: Verdict
    alone: int | None


# None: the session was taken over before the forward could run
Forward = Callable[[DraftRequest | None, float], Awaitable[Forwarded | None]]
Send = Callable[[Verdict], Awaitable[None]]
# Hears, before each forward, what its Verdict will tell the client: rows flow only while
# drafts are asked for (activation_rows.py)
Told = Callable[[Next | None], None]


class Decoding(Protocol):
    """What the loop reads of a session (cloud_server/decoding/session.py)."""

    @property
    def committed(self) -> Sequence[int]: ...

    @property
    def finished(self) -> bool: ...


class DecodeLoop:
    """Runs one session's forwards. `forward(draft, queued_at)` verifies a draft (None: the
    server's own candidates only) on the model; `told` hears what each Verdict will tell the
    client before its forward runs; `draft_nodes()` sizes the draft a Verdict asks for (0: the
    client sizes it); `owned()`: no other stream took the session over;
    `busy()`: other sessions have work on the model; `lead`: the most tokens past the
    client's acknowledgement (None: no bound)."""

    def __init__(self, session: Decoding, inbox: Inbox, rule: PaceRule, forward: Forward,
                 send: Send, lead: int | None = None, owned: Callable[[], bool] = lambda: True,
                 busy: Callable[[], bool] = lambda: False, told: Told = lambda next_: None,
                 draft_nodes: Callable[[], int] = lambda: 0):
        self.session, self.inbox, self.rule = session, inbox, rule
        self._forward, self._send, self._told = forward, send, told
        self._draft_nodes = draft_nodes
        self._lead, self._owned, self._busy = lead, owned, busy
        # the first Verdict is made: the session has its prefill, and the client may answer it
        self.opened = asyncio.Event()

    def _committed(self) -> int:
        return len(self.session.committed)

    async def run(self, first: Callable[[], Awaitable[Verdict]] | None = None) -> None:
        """Sends the Verdict `first()` makes (a prefill's or a resume's), if any, then runs
        forwards until the generation finishes, the client goes away, the lead stops it with
        nobody left to acknowledge, or another stream takes the session over."""
        if first is not None:
            await self._round(partial(self._open, first), measured=False)
        self.opened.set()
        while not self._stopped():
            if not await self.inbox.wait(self._room, None):
                break
            await self.rule.wait(self.inbox, self._committed(), self._busy())
            if self._stopped():  # while it waited, another stream may have taken it over
                break
            if not await self._round(self._forwarding):
                break

    async def _open(self, first: Callable[[], Awaitable[Verdict]]) -> Verdict:
        """Makes the first Verdict, the session opened from then on: a stream that breaks
        while that Verdict is handed to gRPC leaves a session that can go on alone."""
        verdict = await first()
        self.opened.set()
        return verdict

    async def _forwarding(self) -> Forwarded | None:
        return await self._forward(self.inbox.draft, time.perf_counter())

    async def _round(self, make: Callable[[], Awaitable[Forwarded | Verdict | None]],
                     measured: bool = True) -> bool:
        """Decides what the Verdict tells the client, makes it and sends it; False when the
        session was taken over instead. `measured`: the rule learns from its forward."""
        told = self.rule.decide(self._busy())
        self._told(told)
        made = await make()
        if made is None:
            return False
        forwarded = made if isinstance(made, Forwarded) else Forwarded(made, None)
        verdict = replace(forwarded.verdict, next=told,
                          draft_nodes=self._draft_nodes() if told is Next.DRAFT else 0)
        self.inbox.used(verdict.draft_id)
        if measured:
            self.rule.forwarded(len(verdict.tokens), forwarded.alone, verdict.draft_id != 0)
        self.inbox.told(verdict.committed_length, told)
        await self._send(verdict)
        self.rule.sent(verdict.committed_length, told, time.monotonic())
        return True

    def _stopped(self) -> bool:
        return self.session.finished or self.inbox.closed or not self._owned()

    def _room(self) -> bool:
        return self._lead is None or self._committed() - self.inbox.acked < self._lead
