"""Starts `cloud-server --port 0` as a real process and stops it with SIGTERM."""
from __future__ import annotations

import contextlib
import select
import signal
import subprocess
import sys
from typing import Iterator

STARTUP_TIMEOUT_S = 300  # the first start converts the GGUF


@contextlib.contextmanager
def running_server(*extra: str) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--port", "0",
                             "--device", "cpu", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
        assert ready, f"cloud-server printed nothing in {STARTUP_TIMEOUT_S} s"
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), f"unexpected first line {line!r}"
        yield line.removeprefix("listening on ")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
