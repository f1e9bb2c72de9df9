"""Generations run at once through one Batcher, the server's path for many sessions: what the
batching tests and the real-model batching test compare with each session alone."""
from __future__ import annotations

import asyncio
from typing import Any

from cloud_server.decoding.batching import Batcher
from cloud_server.decoding.server_decoding import ServerDecoder, own_drafter
from cloud_server.decoding.session import Session
from cloud_server.model_thread import ModelThread
from shared.drafting.base import DrafterName
from shared.messages import Limits, OpenRequest

LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=600, max_new_tokens=64)


def run_together(target: Any, requests: list[OpenRequest], drafter: DrafterName | None,
                 max_tokens: int = 512) -> tuple[list[list[int]], int]:
    """Runs every request's generation at once through one Batcher (the server's path);
    returns the generated tokens of each and the most sessions one forward ran."""
    most = [0]

    def seen(sessions: int, _tokens: int, _s: float) -> None:
        most[0] = max(most[0], sessions)

    async def one(batcher: Batcher, request: OpenRequest) -> list[int]:
        session = await batcher.model_thread.run(Session.open, target, LIMITS, request)
        decoder = ServerDecoder(session, own_drafter(drafter, LIMITS), 0, ())
        await batcher.run(decoder.prefilling(), session.id)  # keyed, as the service does
        while not session.finished:
            await batcher.run(decoder.stepping(), session.id)
        batcher.forget(session.id)
        return session.committed[len(session.prompt_ids):]

    async def go() -> list[list[int]]:
        batcher = Batcher(ModelThread(), target, max_tokens, seen)
        try:
            return list(await asyncio.gather(*(one(batcher, r) for r in requests)))
        finally:
            batcher.model_thread.shutdown()
    return asyncio.run(go()), most[0]
