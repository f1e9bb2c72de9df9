"""Progress bars: drawn on a terminal, never in a pipe or under --quiet; the artifact download
draws one."""
from __future__ import annotations

import asyncio
import io
import sys

from edge_client.link import ServerLink
from shared import progress
from shared.messages import TOKENIZER_ARTIFACT


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stderr_to(monkeypatch, stream: io.StringIO) -> io.StringIO:
    """Called in the test body: pytest's capture replaces sys.stderr again after fixtures."""
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def draw(total: int = 5) -> None:
    with progress.bar(total, "work", "step") as bar:
        for _ in range(total):
            bar.update()


def test_a_terminal_gets_a_bar_with_rate_and_count(monkeypatch):
    terminal = stderr_to(monkeypatch, Terminal())
    draw()
    assert "work" in terminal.getvalue() and "/5" in terminal.getvalue()
    assert progress.shown() and not progress.log_lines()


def test_a_pipe_gets_no_bar_but_log_lines(monkeypatch):
    pipe = stderr_to(monkeypatch, io.StringIO())
    draw()
    assert pipe.getvalue() == "" and progress.log_lines()


def test_quiet_silences_bars_and_log_lines(monkeypatch):
    terminal = stderr_to(monkeypatch, Terminal())
    monkeypatch.setenv(progress.QUIET_ENV, "1")
    draw()
    assert terminal.getvalue() == "" and not progress.log_lines()


def test_an_artifact_download_shows_its_bytes(monkeypatch, tiny_server):
    terminal = stderr_to(monkeypatch, Terminal())

    async def fetch() -> bytes:
        async with ServerLink(tiny_server.address) as link:
            info = await link.info()
            meta = next(a for a in info.artifacts if a.name == TOKENIZER_ARTIFACT)
            return await link.fetch_artifact(meta.name, meta.sha256, meta.size_bytes)

    data = asyncio.run(fetch())
    assert data and TOKENIZER_ARTIFACT in terminal.getvalue() and "B/s" in terminal.getvalue()
