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


def test_real_model_seeded_sampling_replays_and_races_ignore_the_drafter(real_target):
    from shared.acceptance import AcceptanceMode
    from shared.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    chat = (ChatMessage("user", "Write a short poem about the sea."),)

    async def go(drafter: str, mode: AcceptanceMode):
        options = ClientOptions(drafter, None, 32, sampling, mode)
        async with EdgeClient(server.address, options) as client:
            return (await client.generate(options.open_request(chat=chat))).output_ids

    with ServerThread(real_target) as server:
        race = [asyncio.run(go(d, AcceptanceMode.EXPONENTIAL_RACE)) for d in ("pld", "aded")]
        topk = [asyncio.run(go("aded", AcceptanceMode.TOPK_DRAFTS)) for _ in range(2)]
    assert race[0] == race[1] and len(race[0]) > 0
    assert topk[0] == topk[1]
