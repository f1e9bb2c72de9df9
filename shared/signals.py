"""How the long-running commands (cloud-server, edge-client serve) wait to be stopped."""
from __future__ import annotations

import asyncio
import signal


def stop_requested() -> asyncio.Event:
    """An event set at the first SIGTERM or SIGINT (the container's stop, Ctrl-C).

    Call it before the command prints its readiness line: whoever reads that line may stop
    the command at once, and a signal before the handlers are in kills it without a drain."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    return stopping
