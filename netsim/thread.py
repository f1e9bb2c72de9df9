"""A NetSimProxy on an event loop of its own, for synchronous callers and busy loops."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine

from netsim.conditions import NetworkConditions
from netsim.proxy import NetSimProxy, ProxyStats

THREAD_TIMEOUT_S = 10.0


class ProxyThread:
    """A NetSimProxy on an event loop of its own in a daemon thread, for synchronous callers and
    for callers whose own loop is busy (a drafter on it would make every release late).

        with ProxyThread("127.0.0.1:50051", parse_conditions("4g")) as proxy:
            connect to proxy.address
    """

    def __init__(self, target: str, conditions: NetworkConditions = NetworkConditions(),
                 listen: str = "127.0.0.1:0"):
        self.proxy = NetSimProxy(target, conditions, listen)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netsim",
                                        daemon=True)

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def in_outage(self) -> bool:
        return self.proxy.in_outage

    def stats(self) -> ProxyStats:
        return self.proxy.stats()

    def start_outage(self, duration_s: float) -> concurrent.futures.Future:
        """Begins an outage now without waiting for its end; the future resolves at the end
        (or is cancelled when the proxy stops first)."""
        return asyncio.run_coroutine_threadsafe(self.proxy.outage_now(duration_s), self._loop)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        try:
            self._call(self.proxy.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self.proxy.stop())
        finally:
            self._close_loop()

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(THREAD_TIMEOUT_S)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(THREAD_TIMEOUT_S)
        self._loop.close()
