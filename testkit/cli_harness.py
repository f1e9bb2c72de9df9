"""Starts the long-running CLIs (`cloud-server`, `edge-client serve`) as real processes on free
ports and stops them with SIGTERM."""
from __future__ import annotations

import contextlib
import select
import signal
import socket
import subprocess
import sys
from typing import Iterator

from testkit.device_under_test import SERVER_FLAGS

STARTUP_TIMEOUT_S = 300  # the first start converts the GGUF
QUESTION = "Name the capital city of France."  # one the 4-bit target is sure of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def first_line(command: list[str], prefix: str, timeout_s: float) -> Iterator[str]:
    """Starts a long-running CLI, yields what follows `prefix` on its first stdout line, and
    stops it with SIGTERM on the way out (it must exit 0)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = first_line_of(proc, timeout_s)
        assert line.startswith(prefix), f"unexpected first line {line!r}"
        yield line.removeprefix(prefix)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def server_process(port: int, *extra: str) -> subprocess.Popen:
    """A cloud-server process on `port`, returned once it listens; the caller stops it. For
    tests that kill and restart a server on the same port."""
    proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--port", str(port),
                             *SERVER_FLAGS, "--quiet", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert first_line_of(proc, STARTUP_TIMEOUT_S).startswith("listening on "), "no server"
    return proc


def first_line_of(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line `proc` prints on its stdout (a pipe, text), stripped; fails if it
    prints none within `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"{proc.args} printed nothing in {timeout_s} s"
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def running_server(*extra: str) -> Iterator[str]:
    """A cloud-server on a free port; yields HOST:PORT."""
    with first_line([sys.executable, "-m", "cloud_server.cli", "--port", "0", *SERVER_FLAGS,
                     *extra], "listening on ", STARTUP_TIMEOUT_S) as address:
        yield address


@contextlib.contextmanager
def running_endpoint(server: str, *extra: str) -> Iterator[str]:
    """`edge-client serve` on a free port; yields its base URL (http://HOST:PORT/v1)."""
    with first_line([sys.executable, "-m", "edge_client.cli", "serve", "--server", server,
                     "--port", "0", *extra], "serving ", STARTUP_TIMEOUT_S) as line:
        yield line.split()[0]
