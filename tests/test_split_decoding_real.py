"""End to end on the real SmolLM2-135M-Instruct: split greedy output == plain greedy output."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks import prompts
from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import ChatMessage, OpenRequest
from tests.server_harness import ServerThread

pytestmark = pytest.mark.slow
MAX_NEW = 48


@pytest.fixture(scope="module")
def real_target():
    from cloud_server import model_store
    from cloud_server.target import TargetModel

    return TargetModel.load(*model_store.resolve("default"), device="cpu")


def sample_prompts() -> list[str]:
    return [row["prompt"] for name in prompts.SETS for row in prompts.load(name, limit=2)]


@pytest.mark.parametrize("drafter", ["pld", "aded"])
def test_real_model_split_equals_plain(real_target, drafter):
    texts = sample_prompts()

    async def go():
        options = ClientOptions(drafter, 32, MAX_NEW)
        async with EdgeClient(server.address, options) as client:
            return [await client.generate(OpenRequest(chat=(ChatMessage("user", t),),
                                                      max_new_tokens=MAX_NEW)) for t in texts]

    with ServerThread(real_target) as server:
        results = asyncio.run(go())
    for text, result in zip(texts, results):
        plain = plain_greedy(real_target, result.prompt_ids, MAX_NEW)
        verdict = compare(real_target, result.prompt_ids, result.output_ids, plain)
        assert verdict.lossless, (text[:60], verdict)
    rounds = sum(r.rounds for r in results)
    tokens = sum(len(r.output_ids) for r in results)
    assert rounds < tokens, "speculation never committed more than one token per round"
