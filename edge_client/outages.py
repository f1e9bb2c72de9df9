"""A generation's broken links: when each broke, the pauses between tries to reach the server
again, when to give up, and what the front end is told.

Knows the link policy, not the drafter: the generation drafts offline (offline.py) while it
waits here, and its offline text decides what giving up keeps.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from edge_client.link import ServerUnreachable
from edge_client.offline import Backoff, LinkPolicy, OfflinePolicy
from edge_client.reporting import GenerationResult, Listener
from shared.messages import Opened


@dataclass
class _Outage:
    since: float
    backoff: Backoff


class Outages:
    """The outages of one generation, one at a time; their time adds to `result.outage_s`."""

    def __init__(self, policy: LinkPolicy, listener: Listener, result: GenerationResult):
        self.policy = policy
        self.listener = listener
        self.result = result
        self._outage: _Outage | None = None

    @property
    def down(self) -> bool:
        return self._outage is not None

    @property
    def _down(self) -> _Outage:
        if self._outage is None:
            raise RuntimeError("the link is up")
        return self._outage

    async def ride_out(self, err: ServerUnreachable, offline: list[int],
                       draft_offline: Callable[[], Awaitable[None]]) -> bool:
        """Waits out a broken link, drafting offline as the policy allows. True: try the server
        again; False: it never came back and the policy keeps the unverified text `offline`."""
        if self.policy.reconnect_timeout_s <= 0:
            raise err
        now = time.monotonic()
        if self._outage is None:
            self._outage = _Outage(now, Backoff(self.policy))
            self.listener.link_event(f"link lost: {err}")
        elif now - self._down.since > self.policy.reconnect_timeout_s:
            return self._give_up(err, offline)
        await draft_offline()
        await asyncio.sleep(self._down.backoff.next_wait_s())
        return True

    def _give_up(self, err: ServerUnreachable, offline: list[int]) -> bool:
        waited = f"no server for {self.policy.reconnect_timeout_s:g} s"
        if self.policy.offline is OfflinePolicy.KEEP and offline:
            self.result.unverified_ids = list(offline)
            self.result.outage_s += time.monotonic() - self._down.since
            self.listener.link_event(f"{waited}: keeping {len(offline)} unverified tokens")
            return False
        raise ServerUnreachable(f"{err}; gave up after {waited}") from None

    def link_back(self, opened: Opened, resuming: bool) -> None:
        lost_s = time.monotonic() - self._down.since
        self.result.outage_s += lost_s
        how = ("session resumed" if opened.resumed else
               "session rebuilt from history" if resuming else "generation restarted")
        self.listener.link_event(f"link back after {lost_s:.1f} s, {how}")
        self._outage = None
