"""Waiting for what a test expects the product to do (the server letting go of a broken stream,
the edge committing tokens, a metric growing) by polling the condition itself, never by
sleeping a guessed time.
The deadline only turns a hang into a failure that names what never happened: no test asserts
how long anything took."""
from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client.parser import text_string_to_metric_families

from edge_client.reporting import SilentListener

if TYPE_CHECKING:
    from cloud_server.decoding.session_table import SessionTable

POLL_S = 0.01


def _polls(condition: Callable[[], bool], timeout_s: float, what: str) -> Iterator[None]:
    """Yields while `condition()` does not hold, the caller pausing between polls; fails
    naming `what` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}, in vain"
        yield


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Returns once `condition()` holds, polled from this thread."""
    for _ in _polls(condition, timeout_s, what):
        time.sleep(POLL_S)


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """`wait_until` on an event loop, which runs on between the polls."""
    for _ in _polls(condition, timeout_s, what):
        await asyncio.sleep(POLL_S)


def let_go(sessions: SessionTable, session_id: str) -> bool:
    """Whether no stream owns the session any more: the server noticed its stream end and holds
    the session for a resume, or dropped it."""
    return session_id not in sessions or sessions.orphan(session_id) is not None


async def until_let_go(sessions: SessionTable, session_id: str) -> None:
    await until(lambda: let_go(sessions, session_id), 10,
                f"the server to notice session {session_id}'s stream is gone")


class Progress(SilentListener):
    """An edge listener counting the tokens committed, so a test can act mid-generation."""

    def __init__(self) -> None:
        self.tokens = 0

    def committed(self, ids: list[int]) -> None:
        self.tokens += len(ids)

    async def reached(self, tokens: int) -> None:
        await until(lambda: self.tokens >= tokens, 120, f"{tokens} committed tokens")


def scrape(port: int) -> dict[str, float]:
    """A server's metrics on `port`, every sample named with its labels:
    {'splitdec_forwards_total': 12.0, 'splitdec_sessions_opened_total[new]': 1.0, ...}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
