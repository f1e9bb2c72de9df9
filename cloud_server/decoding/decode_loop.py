"""The server's one decode loop: forward after forward until the generation ends, each verifying
the client's freshest draft (if any) with the server's own candidates, each Verdict sent
(docs/architecture.md, "Pacing").

Every way the server decodes is this loop with a different wait policy (pacing.py) and
forward builder (forward_builder.py): lock-step is AlwaysWait with no candidates of its own;
server pace is NeverWait; auto pace is AutoPace; server-side generation (Generate) and a session
going on after its stream broke are NeverWait over an inbox nobody fills. Flow control keeps
the server at most `lead` tokens past what the client acknowledged. Runs on the event loop;
knows nothing of gRPC or of the model: the caller hands it a forward and a send.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Protocol, Sequence

from cloud_server.decoding.pacing import WaitPolicy
from cloud_server.rpc.stream_buffers import Inbox
from shared.messages import DraftRequest, Verdict


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


class Decoding(Protocol):
    """What the loop reads of a session (cloud_server/decoding/session.py)."""

    @property
    def committed(self) -> Sequence[int]: ...

    @property
    def finished(self) -> bool: ...


class DecodeLoop:
    """Runs one session's forwards. `forward(draft, queued_at)` verifies a draft (None: the
    server's own candidates only) on the model; `owned()`: no other stream took the session
    over; `busy()`: other sessions have work on the model; `lead`: the most tokens past the
    client's acknowledgement (None: no bound)."""

    def __init__(self, session: Decoding, inbox: Inbox, policy: WaitPolicy, forward: Forward,
                 send: Send, lead: int | None = None, owned: Callable[[], bool] = lambda: True,
                 busy: Callable[[], bool] = lambda: False):
        self.session, self.inbox, self.policy = session, inbox, policy
        self._forward, self._send = forward, send
        self._lead, self._owned, self._busy = lead, owned, busy

    def _committed(self) -> int:
        return len(self.session.committed)

    async def run(self) -> None:
        """Until the generation finishes, the client goes away, the lead stops it with nobody
        left to acknowledge, or another stream takes the session over."""
        inbox, policy = self.inbox, self.policy
        policy.sent(self._committed(), time.monotonic())  # the Verdict sent before the loop
        while not self._stopped():
            if not await inbox.wait(self._room, None):
                break
            await policy.wait(inbox, self._committed(), self._busy())
            if self._stopped():  # while it waited, another stream may have taken it over
                break
            fresh, start = inbox.acked >= self._committed(), time.perf_counter()
            forwarded = await self._forward(inbox.draft, start)
            if forwarded is None:
                break
            verdict = forwarded.verdict
            inbox.used(verdict.draft_id)
            policy.forwarded(len(verdict.tokens), fresh, time.perf_counter() - start,
                             forwarded.alone)
            if policy.answer_awaited(inbox, self._busy()):
                verdict = replace(verdict, answer_awaited=True)
            await self._send(verdict)
            policy.sent(verdict.committed_length, time.monotonic())

    def _stopped(self) -> bool:
        return self.session.finished or self.inbox.closed or not self._owned()

    def _room(self) -> bool:
        return self._lead is None or self._committed() - self.inbox.acked < self._lead
