"""Both processes move what they loaded out of the garbage collector's reach
(shared/gc_freeze.py), so a full collection does not stall a generation."""
from __future__ import annotations

import asyncio
import gc

from edge_client.client import ClientOptions, EdgeClient
from tests.server_harness import ServerThread


def _frozen(obj: object) -> bool:
    """Whether `obj` is in the permanent generation: tracked, yet in no collected one."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_a_started_server_leaves_its_model_out_of_the_collector(tiny_target):
    gc.unfreeze()
    assert not _frozen(tiny_target.model)
    with ServerThread(tiny_target):
        assert _frozen(tiny_target.model)
    gc.unfreeze()


def test_a_connected_edge_client_leaves_what_it_loaded_out_of_the_collector(tiny_server):
    async def connect() -> EdgeClient:
        async with EdgeClient(tiny_server.address, ClientOptions("pld", 4, 8)) as client:
            return client

    gc.unfreeze()
    client = asyncio.run(connect())
    assert _frozen(client.link) and _frozen(client.info)
    gc.unfreeze()
