"""Continuous batching of sessions' model work (Orca, Yu et al., OSDI 2022, section 4).

Each session hands its work (target.py's `Work`: a generator yielding the forwards it needs) to
the batcher and awaits the result. Whenever the model thread is free, the batcher takes every
job that is ready, up to `max_tokens` new tokens, and runs them as one ragged forward
(ragged.py); work that needs another forward (the next chunk of a long prompt) joins the next
one and new work joins as it arrives. Nobody waits for a batch to fill: the model waits at most a
quarter of a forward, and only for sessions whose learned turnaround says they are due back
(`_gather`). A session that is not ready (its client is slow, or stopped reading) is simply not
in the batch, so it holds no one back. The batch is taken in arrival order, so under a full
batch every session still gets its turn. Runs on the event loop; the work itself runs on the
model thread.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from cloud_server.model_thread import ModelThread
from shared.drafting.budget import ALONE, Load
from shared.moving_average import ema

if TYPE_CHECKING:  # the CLI reads DEFAULT_MAX_TOKENS without loading torch
    from cloud_server.engine.interface import ForwardJob, Work
    from cloud_server.target import TargetModel

T = TypeVar("T")
DEFAULT_MAX_TOKENS = 512  # new tokens per forward: a CPU forward of that many takes ~0.3 s
# The longest the model waits, as a share of the last forward's time, for sessions due back
# before it runs the next forward without them.
GATHER_SHARE = 0.25
FORGET_S = 10.0  # a session silent this long is no longer expected back
TURNAROUND_WEIGHT = 0.3  # a session's turnaround: about its last three count


@dataclass
class _Rhythm:
    """When a session's last work ended, and how long it takes to hand in the next."""

    done_at: float | None = None
    turnaround_s: float | None = None
    late: bool = False  # missed a gathering: not waited for again until it hands in work

    def submitted(self, now: float) -> None:
        if self.done_at is not None:
            gap = now - self.done_at
            self.turnaround_s = ema(self.turnaround_s, gap, TURNAROUND_WEIGHT)
        self.done_at, self.late = None, False

    def due_by(self, deadline: float) -> bool:
        """Idle now, and expected back before `deadline`."""
        return (self.done_at is not None and self.turnaround_s is not None and not self.late
                and self.done_at + self.turnaround_s <= deadline)


@dataclass
class _Task(Generic[T]):
    work: Work[T]
    future: asyncio.Future
    key: str | None
    job: ForwardJob | None = None
    started: bool = False
    outcome: tuple[bool, Any] | None = None  # (True, result) or (False, error)

    def advance(self) -> None:
        """Runs the work to its next forward, or to its end (model thread)."""
        self.started = True
        try:
            self.job = next(self.work)
        except StopIteration as done:
            self.job, self.outcome = None, (True, done.value)
        except Exception as err:  # noqa: BLE001 - the session's error, raised to its caller
            self.job, self.outcome = None, (False, err)

    def fail(self, err: BaseException) -> None:
        self.job, self.outcome = None, (False, err)
        self.work.close()

    def settle(self) -> None:
        """Hands the outcome to the caller (event loop)."""
        assert self.outcome is not None
        if self.future.done():  # the caller went away (its stream was cancelled)
            return
        ok, value = self.outcome
        self.future.set_result(value) if ok else self.future.set_exception(value)


@dataclass
class Batcher:
    """`max_tokens` 0: one session's work per forward (no batching)."""

    model_thread: ModelThread
    target: TargetModel
    max_tokens: int = DEFAULT_MAX_TOKENS
    on_forward: Callable[[int, int, float], None] = lambda sessions, tokens, seconds: None
    last: Load = ALONE  # what the last forward ran
    _last_s: float = 0.0  # how long it took
    _rhythms: dict[str, _Rhythm] = field(default_factory=dict)
    pending: int = 0  # work handed in and not finished
    _queue: list[_Task] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: asyncio.Task | None = None

    @property
    def batching(self) -> bool:
        return self.max_tokens > 0 and self.target.batchable

    async def run(self, work: Work[T], key: str | None = None) -> T:
        """Runs `work` on the model, its forwards batched with other sessions'. `key` names
        the session: the batcher learns when it hands in work, to gather it into a forward."""
        if key is not None:
            self._rhythms.setdefault(key, _Rhythm()).submitted(time.monotonic())
        task: _Task[T] = _Task(work, asyncio.get_running_loop().create_future(), key)
        self._queue.append(task)
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._serve())
        self.pending += 1
        try:
            return await task.future
        finally:
            self.pending -= 1

    async def _serve(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.batching:
                await self._gather()
            tasks, self._queue = self._queue, []
            try:
                await self.model_thread.run(self._round, tasks)
            except Exception as err:  # noqa: BLE001 - the model thread is gone (shutdown)
                for task in tasks:
                    if task.outcome is None:
                        task.fail(err)
            for task in tasks:
                if task.outcome is not None:
                    task.settle()
                    if task.key in self._rhythms:
                        self._rhythms[task.key].done_at = time.monotonic()
            # Work that needs another forward goes before what arrived meanwhile.
            self._queue = [t for t in tasks if t.outcome is None] + self._queue

    def forget(self, key: str) -> None:
        """The session ended: it hands in no more work."""
        self._rhythms.pop(key, None)

    async def _gather(self) -> None:
        """Waits a little for the sessions due back to hand in their work.

        A session's next work comes some time after its last ended (a client drafts on each
        Verdict, a round trip away), and a forward started the moment the first session is back
        leaves the others for the forward after, so few sessions share a forward (results log,
        `capacity`). The batcher learns each session's turnaround and waits, at most a fraction
        of a forward, for those expected back by then. One that misses it (its client stopped
        reading, its link slowed) is not waited for again until it is back, so it holds no one
        up twice."""
        now = time.monotonic()
        deadline = now + GATHER_SHARE * self._last_s
        for key in [k for k, r in self._rhythms.items()
                    if r.done_at is not None and r.done_at < now - FORGET_S]:
            self.forget(key)
        while any(r.due_by(deadline) for r in self._rhythms.values()):
            left = deadline - time.monotonic()
            self._wake.clear()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                for rhythm in self._rhythms.values():
                    rhythm.late |= rhythm.due_by(deadline)
                return

    def _round(self, tasks: list[_Task]) -> None:
        """One forward on the model thread: picks the ready jobs, runs them together, then
        takes each of them on to its next forward or its end."""
        batch = self._pick(tasks)
        if not batch:
            return
        start = time.perf_counter()
        jobs = [t.job for t in batch if t.job is not None]
        try:
            self.target.run(jobs)
        except Exception as err:  # noqa: BLE001 - raised to every caller in the forward
            for task in batch:
                task.fail(err)
            return
        self.last = Load(len(jobs), sum(len(job.ids) for job in jobs))
        self._last_s = time.perf_counter() - start
        self.on_forward(self.last.sessions, self.last.tokens, self._last_s)
        for task in batch:
            task.advance()

    def _pick(self, tasks: list[_Task]) -> list[_Task]:
        """In arrival order, as many as fit in max_tokens (always the first). Work starts only
        when its forward is about to run, so the time a session measures for its forward
        (Verdict.verify_ms) does not include the forwards it waited for (batched, the one job
        that does not fit waits one forward: its size is known only once it has started)."""
        picked: list[_Task] = []
        tokens = 0
        for task in tasks:
            if picked and not self.batching:
                break
            if not task.started:
                if task.future.done():  # its caller went away before it began
                    task.fail(asyncio.CancelledError())
                    continue
                task.advance()
            if task.job is None:  # finished (or failed) without a forward
                continue
            if picked and tokens + len(task.job.ids) > self.max_tokens:
                break
            picked.append(task)
            tokens += len(task.job.ids)
        return picked
