"""Disconnections at scripted moments of greedy generations on the tiny model, through the netsim
proxy: outages that cut or black-hole the link during the prefill, mid-round and during a resume,
a lost Verdict, and a server restart. Every case must end with exactly the plain greedy text, no
hang past the deadlines and nothing lost (docs/architecture.md, Resume and offline mode)."""
from __future__ import annotations

import asyncio
import random

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkConfig
from edge_client.offline import LinkPolicy, OfflinePolicy
from shared.messages import Limits, Pace
from netsim import LinkProfile, NetworkConditions, OutageMode, ProxyThread
from testkit.cli_harness import free_port
from testkit.waiting import Progress
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread


PROMPT = tuple([5, 6, 7, 8, 5, 6, 7] * 3)
MAX_NEW = 48
LINK = LinkConfig(connect_timeout_s=3.0, resume_timeout_s=1.5, round_timeout_s=10.0)
POLICY = LinkPolicy(reconnect_timeout_s=20.0, offline_limit=24, backoff_max_s=0.5)


def options(policy: LinkPolicy = POLICY, pace: Pace = Pace.LOCKSTEP) -> ClientOptions:
    # One-node trees: ~MAX_NEW rounds of 2 x 15 ms make a generation last ~1.5 s, long enough
    # for an outage to land mid-way however well the drafter guesses. A paced server may run
    # 2 tokens past what the client acknowledged, which paces it by the link much the same.
    return ClientOptions("pld", 1, MAX_NEW, link_policy=policy, pace=pace, lead=2)


async def generate_with_outages(address: str, proxy: ProxyThread,
                                outages: list[tuple[float, float]],
                                policy: LinkPolicy = POLICY, pace: Pace = Pace.LOCKSTEP,
                                after_tokens: int = 0):
    """Generates while outages (start, duration) hit the link; starts count from the request,
    or from the `after_tokens`-th committed token (mid-answer whatever the machine's load)."""
    async with EdgeClient(address, options(policy, pace), LINK) as client:
        progress = Progress()
        task = asyncio.create_task(client.generate(
            client.options.open_request(prompt_ids=PROMPT), progress))
        await progress.reached(after_tokens)
        began = asyncio.get_running_loop().time()
        for start, duration in outages:  # the scripted moments under test, not waits
            await asyncio.sleep(max(0.0, began + start - asyncio.get_running_loop().time()))
            proxy.start_outage(duration)
        return await asyncio.wait_for(task, 60)


def assert_lossless(target, result) -> None:
    plain = plain_greedy(target, PROMPT, MAX_NEW)
    verdict = compare(target, PROMPT, result.output_ids, plain)
    assert verdict.lossless, (verdict, result.output_ids, plain)
    assert result.unverified_ids == []
    assert result.kept_tokens + result.corrected_tokens <= result.offline_tokens


def slow_link(mode: OutageMode) -> NetworkConditions:
    # 2 x 15 ms per round makes a generation last long enough to be hit mid-round
    return NetworkConditions.symmetric(LinkProfile(delay_ms=15), outage_mode=mode)


@pytest.mark.parametrize("pace", [Pace.LOCKSTEP, Pace.AUTO])
# A black hole shows only by keepalive (seconds each): make test cuts, make test-all both.
@pytest.mark.parametrize("mode", [OutageMode.CUT,
                                  pytest.param(OutageMode.BLACKHOLE, marks=pytest.mark.slow)])
@pytest.mark.parametrize("moment", ["prefill", "mid-round", "during resume"])
def test_outage_loses_nothing(isolated_server, tiny_target, mode, moment, pace):
    duration = 0.8 if mode is OutageMode.CUT else 2.5  # a black hole shows only by keepalive
    rng = random.Random(f"{mode}/{moment}")
    # A paced generation here takes ~0.3 s (the server's own lookup drafts run ahead of the
    # one-node client trees), a lock-step one ~0.9 s: mid-round is early enough for both.
    outages = {"prefill": [(0.0, duration)],
               "mid-round": [(rng.uniform(0.08, 0.2), duration)],
               "during resume": [(0.2, duration), (0.2 + duration + 0.05, duration)]}[moment]
    with ProxyThread(isolated_server.address, slow_link(mode)) as proxy:
        result = asyncio.run(generate_with_outages(proxy.address, proxy, outages, pace=pace))
    assert_lossless(tiny_target, result)
    assert result.reconnects >= 1 or moment == "prefill"


def test_offline_text_is_checked_and_corrected(isolated_server, tiny_target):
    with ProxyThread(isolated_server.address, slow_link(OutageMode.CUT)) as proxy:
        result = asyncio.run(generate_with_outages(proxy.address, proxy, [(0.0, 1.0)],
                                                   after_tokens=2))
    assert_lossless(tiny_target, result)
    assert result.offline_tokens > 0, "the drafter drafted nothing while the link was down"
    assert result.outage_s > 0.5


def test_wait_policy_drafts_nothing_offline(isolated_server, tiny_target):
    policy = LinkPolicy(offline=OfflinePolicy.WAIT, reconnect_timeout_s=20.0, backoff_max_s=0.5)
    with ProxyThread(isolated_server.address, slow_link(OutageMode.CUT)) as proxy:
        result = asyncio.run(generate_with_outages(proxy.address, proxy, [(0.3, 1.0)], policy))
    assert_lossless(tiny_target, result)
    assert result.offline_tokens == 0 and result.reconnects >= 1


def test_keep_policy_keeps_unverified_text_when_the_server_never_returns(isolated_server):
    policy = LinkPolicy(offline=OfflinePolicy.KEEP, reconnect_timeout_s=1.0, backoff_max_s=0.3)
    with ProxyThread(isolated_server.address, slow_link(OutageMode.CUT)) as proxy:
        result = asyncio.run(generate_with_outages(proxy.address, proxy, [(0.3, 30.0)], policy))
    assert result.unverified_ids, "no unverified text kept"
    assert len(result.output_ids) + len(result.unverified_ids) <= MAX_NEW


def test_giving_up_raises_after_the_reconnect_timeout(isolated_server):
    from edge_client.link import ServerUnreachable

    policy = LinkPolicy(reconnect_timeout_s=1.0, backoff_max_s=0.3)
    with ProxyThread(isolated_server.address, slow_link(OutageMode.CUT)) as proxy:
        with pytest.raises(ServerUnreachable, match="gave up"):
            asyncio.run(generate_with_outages(proxy.address, proxy, [(0.3, 30.0)], policy))


def test_server_restart_rebuilds_the_session_from_history(tiny_target):
    """The server dies mid-generation and comes back empty: the edge resumes, the server no
    longer knows the session, and rebuilds it from the history the edge sends."""
    port = free_port()
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)

    async def go():
        first = ServerThread(tiny_target, ServerConfig(limits), port).__enter__()
        with ProxyThread(first.address, slow_link(OutageMode.CUT)) as proxy:
            async with EdgeClient(proxy.address, options(), LINK) as client:
                progress = Progress()
                task = asyncio.create_task(client.generate(
                    client.options.open_request(prompt_ids=PROMPT), progress))
                await progress.reached(2)  # the prefill's token and a round's: mid-generation
                await asyncio.to_thread(first.__exit__, None, None, None)
                await asyncio.sleep(0.5)  # the outage under test: down a while, not a wait
                with ServerThread(tiny_target, ServerConfig(limits), port):
                    return await asyncio.wait_for(task, 60)

    result = asyncio.run(go())
    assert_lossless(tiny_target, result)
    assert result.rebuilt_sessions >= 1


@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 6))])
def test_random_outages_over_many_generations(isolated_server, tiny_target, seed):
    """Three outages at random moments of a generation (cut or black hole, 0.2-0.6 s each,
    possibly overlapping), drawn from the seed: every generation ends with the plain text."""
    rng = random.Random(seed)
    mode = rng.choice(list(OutageMode))
    outages = sorted((rng.uniform(0.0, 1.5), rng.uniform(0.2, 0.6)) for _ in range(3))
    pace = Pace.AUTO if seed % 2 else Pace.LOCKSTEP
    with ProxyThread(isolated_server.address, slow_link(mode)) as proxy:
        result = asyncio.run(generate_with_outages(proxy.address, proxy, outages, pace=pace))
    assert_lossless(tiny_target, result)
