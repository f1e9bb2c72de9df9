"""How many generations the endpoint runs at once, and who waits.

At most `max_concurrent` generations run at once, each with a drafter of its own over the one
link; up to `max_queue` more wait their turn in arrival order, and a request past that is
refused at once with 429 and a `Retry-After` the endpoint's own pace suggests, rather than
left waiting behind a queue it cannot see. Knows nothing of HTTP but the refusal's status.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from typing import AsyncIterator

from edge_client.openai_compat.requests import ApiError
from shared.moving_average import ema

# A generation spends most of its time waiting for the server's forwards and the link, and
# drafts a small share of it; a few per core keep the drafting threads busy.
PER_CORE = 4
QUEUE_PER_SLOT = 4  # --max-queue's default, in generations waiting per one running


def default_concurrency() -> int:
    """--max-concurrent's default: a few generations per core of this machine."""
    return PER_CORE * (os.cpu_count() or 1)


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError(f"max_concurrent must be >= 1 and max_queue >= 0, got "
                             f"{max_concurrent} and {max_queue}")
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self._slots = asyncio.Semaphore(max_concurrent)
        self.running = 0
        self.waiting = 0
        self._mean_s: float | None = None  # a generation's running time, a running mean

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Holds one of the slots while the block runs; waits for one in the queue, or raises
        ApiError 429 when the queue is full. A caller cancelled while queued leaves the
        queue."""
        if self.waiting >= self.max_queue and self._slots.locked():
            raise ApiError(429, f"{self.running} requests are being answered and "
                                f"{self.waiting} wait (edge-client serve --max-concurrent "
                                f"{self.max_concurrent} --max-queue {self.max_queue}): "
                                "retry later", kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s())})
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        start = time.monotonic()
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
            took = time.monotonic() - start
            self._mean_s = ema(self._mean_s, took, 0.2)

    def retry_after_s(self) -> int:
        """Seconds until a place in the queue is likely free: a running generation ends about
        every mean generation time / slots."""
        if self._mean_s is None:
            return 1
        return max(1, math.ceil(self._mean_s / self.max_concurrent))
