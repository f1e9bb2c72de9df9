"""The two streams of a Decode session: the Inbox of the client's drafts and acknowledgements,
and the Outbox of Verdicts under flow control. Knows nothing of the rule that decides when to
forward (pacing.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import replace
from typing import Awaitable, Callable

from shared import wire
from shared.errors import OutOfOrder
from shared.messages import ActivationRows, DraftRequest, Next, Verdict


class Inbox:
    """The freshest client draft and the longest committed length the client acknowledged,
    filled by the stream's reader as messages arrive. `answers_each` (lock-step): every draft
    answers the latest Verdict, so one from an older length is out of order; so is a draft
    from a Verdict that said rest (`told`). `fed` False: no client fills it (server-side
    generation, a session going on after its stream broke); nothing is waited for."""

    def __init__(self, acked: int, answers_each: bool = False, fed: bool = True):
        self.answers_each, self.fed = answers_each, fed
        self.draft: DraftRequest | None = None
        self.acked = acked
        self.acked_at = time.monotonic()
        self.closed = False  # the client closed its side, or the stream ended
        self.answers = 0  # messages put
        self._resting: set[int] = set()  # committed lengths whose Verdict said rest
        self._last_id = 0
        self._changed = asyncio.Event()

    def put(self, draft: DraftRequest, committed: int) -> None:
        if draft.round_id <= self._last_id:
            raise OutOfOrder(f"draft {draft.round_id} after draft {self._last_id}: ids must grow")
        if draft.base_length > committed or (self.answers_each
                                             and draft.base_length < committed):
            raise OutOfOrder(f"draft continues {draft.base_length} tokens, but {committed} are "
                             "committed")
        if len(draft.tree) and draft.base_length in self._resting:
            raise OutOfOrder(f"draft {draft.round_id} continues {draft.base_length} tokens, "
                             "where the server said rest: draft only from a Verdict that "
                             "says draft")
        self._last_id = draft.round_id
        self.answers += 1
        if draft.base_length > self.acked:
            self.acked, self.acked_at = draft.base_length, time.monotonic()
            self._resting = {n for n in self._resting if n >= self.acked}
        if len(draft.tree):
            self.draft = draft
        self._wake()

    def told(self, committed: int, told: Next | None) -> None:
        """The Verdict that made `committed` told the client `told`."""
        if told is Next.REST:
            self._resting.add(committed)

    def close(self) -> None:
        self.closed = True
        self._wake()

    def used(self, draft_id: int) -> None:
        """A forward verified that draft: what it did not accept can never continue the text."""
        if self.draft is not None and self.draft.round_id == draft_id:
            self.draft = None

    async def wait(self, ready: Callable[[], bool], timeout_s: float | None) -> bool:
        """Waits until `ready()` or the stream closes, at most `timeout_s`; returns ready()."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ready() and not self.closed and self.fed:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return ready()

    def _wake(self) -> None:
        self._changed.set()


# Outbox.send: the longest a paced forward waits for the stream to take the previous Verdict.
# Serialized and handed to gRPC, its write completed, before the next forward starts, as a
# server-only generation's is: neither the serializing nor the completion (gRPC's poller thread
# and then the event loop waking) takes the interpreter lock and the core from the forward.
# So a paced session's time per forward is level with server-spec's (results log,
# `latency_s27_moa`). A link that does not take the Verdict within this holds nothing back:
# the outbox then writes it alone.
HAND_OFF_S = 0.005


class Outbox:
    """A paced session's messages, written to its stream in order by a task of their own, so a
    forward never waits for the link to take the previous Verdict (a slow link, the prompt's
    activation rows): the server runs at its own pace, bounded by the lead alone. (`send`
    waits for gRPC to take a Verdict, HAND_OFF_S at most and only when nothing else is being
    written: the hand-off, not the link.)

    `parts` cuts a Verdict into what goes out: the Verdict, then the rows that trail it
    (wire.trailing). With `rows_in_flight` (bytes; the client acknowledges the rows it holds,
    `held`), rows go out while fewer than that many bytes of them are unacknowledged, and every
    Verdict goes before the rows waiting: a Verdict then queues behind at most that much on the
    link. Without it, a prompt's rows filled the client's 64 KB HTTP/2 window
    (edge_client/link.py) and the Verdicts behind them waited a round trip for the window to
    reopen (results log, `latency_packed`). A Verdict's own few rows go inside it only while
    none wait and the budget has room; else they join the backlog behind the others, so rows
    arrive in order. While the Verdicts tell the client to rest, rows are paused (`pause`):
    those waiting stay until a Verdict asks for a draft again, and the session computes no
    new ones meanwhile (cloud_server/decoding/activation_rows.py). `flush`
    drops the rows still waiting at the end (and wire.trailing cuts a last Verdict's many rows):
    nobody drafts past the end.
    """

    def __init__(self, write: Callable[[Verdict | ActivationRows], Awaitable[None]],
                 parts: Callable[[Verdict], list] = lambda verdict: [verdict],
                 rows_in_flight: int | None = None):
        self._parts = parts
        self._budget = rows_in_flight
        # (the Verdict, the rows that trail it); None: flush
        self._verdicts: deque[tuple[Verdict, list[ActivationRows]] | None] = deque()
        self._rows: deque[ActivationRows] = deque()
        self._written_end: int | None = None  # the end of the last rows written
        self._held = 0  # rows the client holds
        self._paused = False  # the client is told to rest: it wants no rows for now
        self._wake = asyncio.Event()
        self._handed = asyncio.Event()  # set: every Verdict put is handed to the stream
        self._handed.set()
        self._writing = False  # a write is under way
        self._task = asyncio.create_task(self._drain(write))

    async def put(self, verdict: Verdict) -> None:
        if self._task.done():  # the writer stopped: raise what stopped it (a broken stream)
            await self._task
        head, *rows = self._parts(verdict)
        self._verdicts.append((head, rows))
        self._handed.clear()
        self._wake.set()

    async def send(self, verdict: Verdict) -> None:
        """Puts `verdict` and, when the writer was idle, waits until the stream has taken it,
        at most HAND_OFF_S. A writer still busy (rows, or a Verdict the link has not taken)
        is not waited for: on a link that holds it up, every forward would wait the whole
        HAND_OFF_S for nothing."""
        idle = not self._writing
        await self.put(verdict)
        if idle and not self._handed.is_set():
            # every forward passes here: a timer alone, not wait_for's task and timer
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HAND_OFF_S):
                    await self._handed.wait()

    def held(self, rows: int) -> None:
        """The client holds the activation rows of positions [0, rows)."""
        self._held = max(self._held, rows)
        self._wake.set()

    def pause(self, paused: bool) -> None:
        """Holds the rows waiting while the client rests (`paused`), or lets them go."""
        if paused is not self._paused:
            self._paused = paused
            self._wake.set()

    async def flush(self) -> None:
        """Waits until every Verdict put is written; the outbox takes nothing after."""
        self._verdicts.append(None)
        self._wake.set()
        await self._task

    def cancel(self) -> None:
        self._task.cancel()

    async def _drain(self, write: Callable[[Verdict | ActivationRows], Awaitable[None]]) -> None:
        while True:
            self._wake.clear()
            if self._verdicts:
                item = self._verdicts.popleft()
                if item is None:
                    return
                verdict = self._behind_waiting_rows(*item)
                if verdict.activations is not None:
                    self._written(verdict.activations)
                await self._write(write, verdict)
                if not self._verdicts:
                    self._handed.set()
            elif self._rows and self._may_send(self._rows[0]):
                rows = self._rows.popleft()
                self._written(rows)
                await self._write(write, rows)
            else:
                await self._wake.wait()

    async def _write(self, write: Callable[[Verdict | ActivationRows], Awaitable[None]],
                     msg: Verdict | ActivationRows) -> None:
        self._writing = True
        try:
            await write(msg)
        finally:
            self._writing = False

    def _behind_waiting_rows(self, verdict: Verdict, rows: list[ActivationRows]) -> Verdict:
        """`verdict` as it goes out now: its own rows inside it, or moved to the backlog with
        the rows that trail it. Decided as it is written, so the backlog stays in order."""
        inline = verdict.activations
        if inline is not None and (self._rows or not self._may_send(inline)):
            rows = [inline, *rows]
            verdict = replace(verdict, activations=None)
        self._rows.extend(rows)
        return verdict

    def _may_send(self, rows: ActivationRows) -> bool:
        if self._paused:
            return False
        if self._budget is None or self._written_end is None:
            return True
        unacknowledged = max(0, self._written_end - self._held) * wire.row_bytes(rows)
        return unacknowledged == 0 or unacknowledged + wire.rows_bytes(rows) <= self._budget

    def _written(self, rows: ActivationRows) -> None:
        self._written_end = rows.start + len(rows.values)
