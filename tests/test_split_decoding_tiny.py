"""Greedy split decoding over loopback emits exactly what plain greedy decoding emits."""
from __future__ import annotations

import asyncio

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import FinishReason, OpenRequest
from testkit.tiny_prompts import MAX_NEW, PROMPTS


def split_outputs(address: str, drafter: str, tree_nodes: int | None):
    async def go():
        options = ClientOptions(drafter, tree_nodes, MAX_NEW)
        async with EdgeClient(address, options) as client:
            return [await client.generate(OpenRequest(prompt_ids=tuple(p),
                                                      max_new_tokens=MAX_NEW))
                    for p in PROMPTS]
    return asyncio.run(go())


@pytest.mark.parametrize("drafter", ["pld", "aded"])
@pytest.mark.parametrize("tree_nodes", [1, 16, None])
def test_split_greedy_equals_plain(tiny_server, tiny_target, drafter, tree_nodes):
    results = split_outputs(tiny_server.address, drafter, tree_nodes)
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        verdict = compare(tiny_target, prompt, result.output_ids, plain)
        assert verdict.lossless, (prompt, verdict, result.output_ids, plain)
        assert result.prompt_ids == prompt
        assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN)
        assert result.bytes_up > 0 and result.bytes_down > 0
    assert sum(r.accepted_tokens for r in results) > 0, "no draft was ever accepted"


def test_stats_add_up(tiny_server):
    for r in split_outputs(tiny_server.address, "pld", 16):
        # The last round's own token may be cut by max_new_tokens.
        assert r.rounds + r.accepted_tokens <= len(r.output_ids) <= 1 + r.rounds + r.accepted_tokens
        assert r.accepted_tokens <= r.drafted_tokens
        assert r.server_calls == r.rounds + 2  # Open, a draft a round, Close
        assert 0 < r.ttft_s <= r.wall_s


def test_concurrent_sessions_do_not_mix(tiny_server, tiny_target):
    """Several generations at once on one server, interleaving rounds, each still exact."""
    async def go():
        options = ClientOptions("aded", 8, MAX_NEW)
        async with EdgeClient(tiny_server.address, options) as client:
            return await asyncio.gather(*(
                client.generate(OpenRequest(prompt_ids=tuple(p), max_new_tokens=MAX_NEW))
                for p in PROMPTS))
    for prompt, result in zip(PROMPTS, asyncio.run(go())):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
