"""The one thread that loads and runs the target model, off the gRPC event loop.

Loading and running on the same thread matters on the CPU: OpenMP keeps a thread team per
calling thread, and a model loaded on the main thread but run on a worker ran its tree forward
in ~64 ms instead of ~43 ms on this 2-core machine (two teams competing for two cores).
One thread also serializes forward passes, so sessions never race on the model.
"""
from __future__ import annotations

import asyncio
import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

MODEL_THREAD_NAME = "model"
_PR_SET_NAME = 15  # prctl(2)


def _name_os_thread() -> None:
    """Gives the calling thread its name in the OS too (Python 3.11 keeps thread names to
    itself), so `top -H`, `py-spy` and benchmarks/server_cpu.py tell the model's CPU time from
    the event loop's and gRPC's. Linux only; elsewhere the thread stays unnamed."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_NAME, MODEL_THREAD_NAME.encode(), 0, 0, 0)


class ModelThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=MODEL_THREAD_NAME,
                                            initializer=_name_os_thread)

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs `fn` on the model thread and waits (startup, outside the event loop)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
