"""End to end on the real SmolLM2-135M-Instruct: split greedy output == plain greedy output."""
from __future__ import annotations

import asyncio

import pytest

from shared import prompt_sets as prompts
from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import ChatMessage, OpenRequest
from testkit.device_under_test import load_target
from testkit.waiting import Progress
from tests.server_harness import ServerThread

pytestmark = pytest.mark.slow
MAX_NEW = 48


@pytest.fixture(scope="module")
def real_target():
    from cloud_server import model_store

    return load_target(*model_store.resolve("default"))


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
    from shared.messages import Pace
    from shared.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    chat = (ChatMessage("user", "Write a short poem about the sea."),)

    async def go(options: ClientOptions):
        async with EdgeClient(server.address, options) as client:
            return (await client.generate(options.open_request(chat=chat))).output_ids

    def race_options(drafter: str) -> ClientOptions:
        """Trees sized from measured timings and paced: drafts differ from run to run."""
        return ClientOptions(drafter, None, 32, sampling, AcceptanceMode.EXPONENTIAL_RACE,
                             pace=Pace.AUTO)

    # topk-drafts' text depends on what was drafted, so it replays only with the same trees:
    # a fixed size, one forward per draft.
    topk_options = ClientOptions("aded", 8, 32, sampling, AcceptanceMode.TOPK_DRAFTS,
                                 pace=Pace.LOCKSTEP)
    with ServerThread(real_target) as server:
        race = [asyncio.run(go(race_options(d))) for d in ("pld", "aded")]
        topk = [asyncio.run(go(topk_options)) for _ in range(2)]
    assert race[0] == race[1] and len(race[0]) > 0
    assert topk[0] == topk[1]


@pytest.mark.parametrize("mode, outage_s", [("cut", 1.0), ("blackhole", 2.5)])
def test_real_model_outage_mid_generation_loses_nothing(real_target, mode, outage_s):
    """An outage a moment after the answer starts: the edge drafts offline, resumes, has its
    offline text checked, and ends with exactly the plain greedy answer."""
    from netsim import LinkProfile, NetworkConditions, OutageMode, ProxyThread

    chat = (ChatMessage("user", sample_prompts()[2]),)
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=10),
                                             outage_mode=OutageMode(mode))

    async def go(address: str, proxy: ProxyThread):
        async with EdgeClient(address, ClientOptions("pld", None, MAX_NEW)) as client:
            progress = Progress()
            task = asyncio.create_task(
                client.generate(OpenRequest(chat=chat, max_new_tokens=MAX_NEW), progress))
            await progress.reached(2)  # the prefill's token and a round's: the answer started
            proxy.start_outage(outage_s)
            return await asyncio.wait_for(task, 120)

    with ServerThread(real_target) as server, ProxyThread(server.address, conditions) as proxy:
        result = asyncio.run(go(proxy.address, proxy))
    plain = plain_greedy(real_target, result.prompt_ids, MAX_NEW)
    assert compare(real_target, result.prompt_ids, result.output_ids, plain).lossless
    assert result.reconnects >= 1 and result.outage_s > 0.5
    assert result.corrected_tokens <= result.offline_tokens and not result.unverified_ids


def test_real_sessions_batched_together_write_what_each_writes_alone(real_target):
    """Chat prompts of different lengths from the three evaluation sets, verified together in
    ragged forwards (server-side lookup trees of different sizes), each equal to its plain
    greedy decoding."""
    from shared.drafting.base import DrafterName
    from testkit.batched_runs import run_together

    requests = [OpenRequest(chat=(ChatMessage("user", p),), max_new_tokens=24)
                for p in sample_prompts()[:4]]
    together, most = run_together(real_target, requests, DrafterName.PLD)
    assert most >= 3
    for request, ids in zip(requests, together):
        prompt = real_target.apply_chat_template(request.chat)
        assert ids == plain_greedy(real_target, prompt, 24)
