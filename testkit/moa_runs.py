"""What the tests of the MoA drafter through the real server and client share: the server's
limits, the tiny target's prompts, and `run`, which generates each prompt in turn through one
edge client."""
from __future__ import annotations

import asyncio
from typing import Sequence

from edge_client.client import ClientOptions, EdgeClient
from shared.messages import Limits

PROMPTS = [(1, 46, 47, 48, 49), (1, 52, 53, 54, 55), (1, 60, 61, 62)]
MAX_NEW = 32
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)


def run(address: str, options: ClientOptions, prompts: Sequence[tuple[int, ...]] = PROMPTS):
    async def go():
        async with EdgeClient(address, options) as client:
            return [await client.generate(client.options.open_request(prompt_ids=p))
                    for p in prompts]
    return asyncio.run(go())
