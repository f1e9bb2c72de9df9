"""How the long-running commands (cloud-server, edge-client serve) wait to be stopped."""
from __future__ import annotations

import asyncio
import signal


async def until_stopped() -> None:
    """Returns at the first SIGTERM or SIGINT (the container's stop, Ctrl-C)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
