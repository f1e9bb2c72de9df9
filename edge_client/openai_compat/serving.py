"""Runs the endpoint: one EdgeClient (one link) for every request, a drafting thread for each
generation at once."""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from aiohttp import web

from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkConfig
from edge_client.openai_compat.admission import (
    QUEUE_PER_SLOT, Admission, default_concurrency,
)
from edge_client.openai_compat.app import Endpoint
from shared.signals import stop_requested


@dataclass(frozen=True)
class Capacity:
    """Generations at once (None: sized to the machine, within the server's session limit)
    and requests waiting past them (None: a few per generation at once)."""

    max_concurrent: int | None = None
    max_queue: int | None = None

    @property
    def threads(self) -> int:
        """Drafting threads: one per generation at once, started as they are needed."""
        return self.max_concurrent or default_concurrency()

    def admission(self, server_sessions: int) -> Admission:
        concurrent = self.max_concurrent or min(default_concurrency(), server_sessions)
        queue = QUEUE_PER_SLOT * concurrent if self.max_queue is None else self.max_queue
        return Admission(concurrent, queue)


@contextlib.asynccontextmanager
async def running_endpoint(address: str, options: ClientOptions, host: str, port: int,
                           config: LinkConfig = LinkConfig(), capacity: Capacity = Capacity()
                           ) -> AsyncIterator[tuple[EdgeClient, int]]:
    """Connects to the cloud-server at `address` (fails fast if it is not there), then serves
    on HOST:PORT; yields the client and the bound port."""
    with ThreadPoolExecutor(capacity.threads, "drafting") as drafting:
        async with EdgeClient(address, options, config, drafting) as client:
            admission = capacity.admission(client.info.limits.max_sessions)
            # A client that hangs up cancels its handler, and so its generation (app.py)
            runner = web.AppRunner(Endpoint(client, admission).app(), access_log=None,
                                   handler_cancellation=True)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port).start()
                yield client, runner.addresses[0][1]
            finally:
                await runner.cleanup()


async def serve(address: str, options: ClientOptions, host: str, port: int,
                config: LinkConfig = LinkConfig(), capacity: Capacity = Capacity()) -> None:
    """Serves until SIGINT or SIGTERM; the first line on stdout is
    `serving http://HOST:PORT/v1 (MODEL)`."""
    async with running_endpoint(address, options, host, port, config, capacity) as (client,
                                                                                    bound):
        stopping = stop_requested()
        print(f"serving http://{host}:{bound}/v1 ({client.info.model_id})", flush=True)
        await stopping.wait()
