"""The baselines from the edge: the server generates alone and streams what it commits.

`plain-api` is a plain streaming API (one target forward per token); `server-spec` is
speculative decoding with a drafter the server runs next to the target. Both go through the
same link as split decoding, so a user compares the three in their own experiment
(`edge-client --mode`). No drafter runs on the edge; no resume: a broken stream fails the call.
"""
from __future__ import annotations

import enum
import time

from edge_client.reporting import GenerationResult, Listener, SilentListener
from edge_client.link import GRPC_FRAME_BYTES, LinkError, ServerLink
from shared import wire
from shared.messages import Done, GenerateRequest, OpenRequest, Opened, Verdict

# What server-spec runs unless told: Token Recycling, the best drafter a server runs alone
# (results log, `recycle_tau`); a server older than it refuses the name, say
# --server-drafter pld
SERVER_DRAFTER = "recycle"


class Mode(enum.Enum):
    SPLIT = "split"  # the edge drafts, the server verifies (generate.py)
    SERVER_SPEC = "server-spec"
    PLAIN_API = "plain-api"


async def server_generate(link: ServerLink, request: OpenRequest, mode: Mode,
                          listener: Listener | None = None,
                          drafter: str = SERVER_DRAFTER) -> GenerationResult:
    """Runs one server-only generation to its end; under server-spec the server drafts with
    `drafter` (one of its own: pld, aded, recycle)."""
    listener = listener or SilentListener()
    generate = GenerateRequest(request, drafter if mode is Mode.SERVER_SPEC else None)
    result = GenerationResult(server_only=True)
    result.bytes_up = wire.generate_to_proto(generate).ByteSize() + GRPC_FRAME_BYTES
    start = time.perf_counter()
    async for msg, size in link.generate(generate):
        result.bytes_down += size
        if isinstance(msg, Opened):
            result.prompt_ids = list(msg.prompt_ids)
        elif isinstance(msg, Verdict):
            _take(result, msg, start, listener)
        elif isinstance(msg, Done):
            result.finish_reason = msg.finish_reason
    if not result.prompt_ids:
        raise LinkError("protocol error: the server's stream ended before Opened")
    result.wall_s = time.perf_counter() - start
    return result


def _take(result: GenerationResult, verdict: Verdict, start: float, listener: Listener) -> None:
    if not result.output_ids:
        result.ttft_s = time.perf_counter() - start
        result.prefill_s = verdict.verify_ms / 1000
    else:
        result.rounds += 1  # forwards after the prefill
    result.accepted_tokens += len(verdict.accepted_nodes)
    result.output_ids.extend(verdict.tokens)
    result.verify_s += verdict.verify_ms / 1000
    if verdict.tokens:
        listener.committed(list(verdict.tokens))
