"""Runs the endpoint: one EdgeClient (one link, one drafter) for every request."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

from aiohttp import web

from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkConfig
from edge_client.openai_compat.app import Endpoint
from shared.signals import until_stopped


@contextlib.asynccontextmanager
async def running_endpoint(address: str, options: ClientOptions, host: str, port: int,
                           config: LinkConfig = LinkConfig()
                           ) -> AsyncIterator[tuple[EdgeClient, int]]:
    """Connects to the cloud-server at `address` (fails fast if it is not there), then serves
    on HOST:PORT; yields the client and the bound port."""
    async with EdgeClient(address, options, config) as client:
        runner = web.AppRunner(Endpoint(client).app(), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            yield client, runner.addresses[0][1]
        finally:
            await runner.cleanup()


async def serve(address: str, options: ClientOptions, host: str, port: int,
                config: LinkConfig = LinkConfig()) -> None:
    """Serves until SIGINT or SIGTERM; the first line on stdout is
    `serving http://HOST:PORT/v1 (MODEL)`."""
    async with running_endpoint(address, options, host, port, config) as (client, bound):
        print(f"serving http://{host}:{bound}/v1 ({client.info.model_id})", flush=True)
        await until_stopped()
