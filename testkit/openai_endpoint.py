"""`edge-client serve`'s endpoint in-process for tests, driven by the official `openai` client:
`serve_and` runs a scenario against it, `streamed` reads a streamed completion whole."""
from __future__ import annotations

import asyncio

import openai

from edge_client.client import ClientOptions
from edge_client.link import LinkConfig
from edge_client.offline import LinkPolicy
from edge_client.openai_compat.serving import Capacity, running_endpoint
from shared.messages import Pace

# One-node trees on the tiny model: a generation takes a round per token.
OPTIONS = ClientOptions("pld", 1, 48, link_policy=LinkPolicy(reconnect_timeout_s=20.0),
                        pace=Pace.LOCKSTEP)
LINK = LinkConfig(connect_timeout_s=3.0, resume_timeout_s=1.5, round_timeout_s=10.0)


def serve_and(address: str, scenario, options: ClientOptions = OPTIONS,
              capacity: Capacity = Capacity()):
    """Runs `scenario(openai_client, base_url, edge_client)` against a running endpoint."""
    async def run():
        async with running_endpoint(address, options, "127.0.0.1", 0, LINK,
                                    capacity) as (edge, port):
            base = f"http://127.0.0.1:{port}/v1"
            api = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
            return await scenario(api, base, edge)
    return asyncio.run(run())


async def streamed(api: openai.AsyncOpenAI, **kwargs):
    """(the text, the chunks) of a streamed completion."""
    stream = await api.completions.create(stream=True, **kwargs)
    chunks = [c async for c in stream]
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks
