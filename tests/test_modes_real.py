"""One end-to-end smoke test per way of decoding, on the real SmolLM2 with the server's default
CPU engine (4-bit): server-side speculation, the plain API and split decoding across a cut link
each write the engine's own plain greedy text. The matrices (every drafter, pace, rule and
outage, fp32) are `make test-all`'s (tests marked slow)."""
from __future__ import annotations

import asyncio

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.server_only import Mode
from netsim import LinkProfile, NetworkConditions, OutageMode, ProxyThread
from shared.messages import ChatMessage, OpenRequest
from testkit.waiting import Progress

CHAT = (ChatMessage("user", "Explain in two sentences why the sky is blue."),)
MAX_NEW = 32


def generate(address: str, options: ClientOptions):
    async def go():
        async with EdgeClient(address, options) as client:
            return await client.generate(OpenRequest(chat=CHAT, max_new_tokens=MAX_NEW))
    return asyncio.run(go())


@pytest.mark.parametrize("mode", [Mode.SERVER_SPEC, Mode.PLAIN_API])
def test_a_baseline_mode_writes_the_plain_greedy_text(real_q4_target, real_q4_server, mode):
    result = generate(real_q4_server.address, ClientOptions("pld", None, MAX_NEW, mode=mode))
    assert len(result.output_ids) == MAX_NEW
    assert result.output_ids == plain_greedy(real_q4_target, result.prompt_ids, MAX_NEW)


def test_split_decoding_across_a_cut_link_writes_the_plain_greedy_text(real_q4_target, real_q4_server):
    """A cut a moment after the answer starts: the edge drafts offline, reconnects, resumes,
    has its offline text checked, and ends with exactly the engine's plain greedy answer."""
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=10),
                                             outage_mode=OutageMode.CUT)

    async def go(proxy: ProxyThread):
        options = ClientOptions("pld", None, MAX_NEW)
        async with EdgeClient(proxy.address, options) as client:
            progress = Progress()
            task = asyncio.create_task(
                client.generate(OpenRequest(chat=CHAT, max_new_tokens=MAX_NEW), progress))
            await progress.reached(1)
            proxy.start_outage(1.0)
            return await asyncio.wait_for(task, 120)

    with ProxyThread(real_q4_server.address, conditions) as proxy:
        result = asyncio.run(go(proxy))
    plain = plain_greedy(real_q4_target, result.prompt_ids, MAX_NEW)
    assert compare(real_q4_target, result.prompt_ids, result.output_ids, plain).lossless
    assert result.reconnects >= 1 and not result.unverified_ids
