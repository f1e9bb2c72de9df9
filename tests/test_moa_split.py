"""The MoA drafter through the real server and client on the tiny target: the server offers
the bundle, the edge fetches and caches it, Verdicts carry the server half's activations, and
greedy split decoding stays identical to plain greedy decoding, through an outage too."""
from __future__ import annotations

import asyncio

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafters.moa_bundle import bundle_cache_dir
from edge_client.link import LinkError, ServerLink
from shared.acceptance import AcceptanceMode
from shared.messages import (
    ActivationFormat, ArtifactKind, FinishReason, Limits, OpenRequest, Pace,
)
from netsim import LinkProfile, NetworkConditions, OutageMode, ProxyThread
from shared.sampling import SamplingParams
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

PROMPTS = [(1, 46, 47, 48, 49), (1, 52, 53, 54, 55), (1, 60, 61, 62)]
MAX_NEW = 32
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)


@pytest.fixture(scope="module")
def moa_server(tiny_target, tiny_drafter_dir):
    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        yield server


def run(address: str, options: ClientOptions, prompts=PROMPTS):
    async def go():
        async with EdgeClient(address, options) as client:
            return [await client.generate(client.options.open_request(prompt_ids=p))
                    for p in prompts]
    return asyncio.run(go())


@pytest.mark.parametrize("fmt, pace", [(ActivationFormat.FP16, Pace.LOCKSTEP),
                                       (ActivationFormat.INT8, Pace.LOCKSTEP),
                                       (ActivationFormat.FP16, Pace.AUTO),
                                       (ActivationFormat.INT8, Pace.SERVER)])
def test_moa_split_greedy_equals_plain(moa_server, tiny_target, fmt, pace, tmp_path,
                                       monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    results = run(moa_server.address, ClientOptions("moa", 16, MAX_NEW, activation_format=fmt,
                                                    pace=pace))
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
    tokens = sum(len(r.output_ids) for r in results)
    assert sum(r.rounds for r in results) < tokens / 1.5, "the MoA drafts are rarely accepted"
    bundle = next(a for a in moa_server.service.info().artifacts
                  if a.kind is ArtifactKind.DRAFTER_BUNDLE)
    assert bundle_cache_dir(bundle.sha256).is_dir()  # fetched once, cached by sha256


@pytest.mark.parametrize("pace", [Pace.LOCKSTEP, Pace.SERVER])
def test_draft_graphs_travel_folded_and_stay_lossless(tiny_target, tiny_drafter_dir, pace,
                                                      tmp_path, monkeypatch):
    """--draft-graphs: the drafts reach the server with aliases (each repeated subtree once),
    it unrolls them, and the text equals plain greedy."""
    from shared import wire

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    aliases = []
    decode = wire.client_from_proto

    def counted(raw, max_tree_nodes):
        aliases.append(len(raw.draft.alias_nodes) if raw.HasField("draft") else 0)
        return decode(raw, max_tree_nodes)

    monkeypatch.setattr(wire, "client_from_proto", counted)
    limits = Limits(max_tree_nodes=48, max_tree_depth=8, max_new_tokens=64)
    # the `last` student: of the tiny drafters, its trees repeat a token at a depth in both paces
    config = ServerConfig(limits, drafter_dir=tiny_drafter_dir / "last")
    with ServerThread(tiny_target, config) as server:
        results = run(server.address, ClientOptions("moa", 48, MAX_NEW, pace=pace,
                                                    draft_graphs=True))
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
    assert sum(aliases) > 0


def test_draft_graphs_need_a_server_that_unrolls_them(moa_server, tmp_path, monkeypatch):
    """A server that does not say it unrolls graphs (an older one) would verify their spanning
    trees under other node ids: the client refuses to send it any."""
    from dataclasses import replace as replaced

    from edge_client.link import ServerLink

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    info = ServerLink.info

    async def older_server(self):
        return replaced(await info(self), draft_graphs=False)

    monkeypatch.setattr(ServerLink, "info", older_server)
    with pytest.raises(LinkError, match="does not unroll draft graphs"):
        run(moa_server.address, ClientOptions("moa", 16, MAX_NEW, draft_graphs=True))


def test_moa_keeps_drafting_through_an_outage(moa_server, tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=15),
                                             outage_mode=OutageMode.CUT)

    async def go(proxy: ProxyThread):
        async with EdgeClient(proxy.address, ClientOptions("moa", 1, MAX_NEW)) as client:
            task = asyncio.create_task(
                client.generate(OpenRequest(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW)))
            await asyncio.sleep(0.3)
            proxy.start_outage(1.0)
            return await asyncio.wait_for(task, 60)

    with ProxyThread(moa_server.address, conditions) as proxy:
        result = asyncio.run(go(proxy))
    plain = plain_greedy(tiny_target, PROMPTS[0], MAX_NEW)
    assert compare(tiny_target, PROMPTS[0], result.output_ids, plain).lossless
    assert result.offline_tokens > 0 and result.reconnects >= 1


def test_moa_is_refused_by_a_server_without_a_drafter(tiny_server):
    with pytest.raises(LinkError, match="no trained drafter"):
        run(tiny_server.address, ClientOptions("moa", 8, MAX_NEW))


def test_independent_baseline_served_without_activations(tiny_target, tiny_drafter_dir,
                                                         tmp_path, monkeypatch):
    """A server given the Independent baseline offers its bundle and no activations; the edge
    runs it self-fed and stays lossless."""
    from cloud_server.training.moa import INDEPENDENT

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    config = ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir / INDEPENDENT)
    with ServerThread(tiny_target, config) as server:
        assert server.service.info().activation_width == 0
        results = run(server.address, ClientOptions("moa", 16, MAX_NEW))
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
        assert result.bytes_down < 100 * len(result.output_ids)  # no 128 B activation rows


@pytest.mark.parametrize("server_name, chosen", [("moa_server", "moa"),
                                                  ("tiny_server", "pld")])  # none offered
def test_auto_drafter_picks_moa_when_offered(request, server_name, chosen, tmp_path,
                                             monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    address = request.getfixturevalue(server_name).address

    async def go():
        async with EdgeClient(address, ClientOptions("auto", 8, MAX_NEW)) as client:
            return client.options.drafter
    assert asyncio.run(go()) == chosen


@pytest.mark.parametrize("acceptance", [AcceptanceMode.SAMPLED_DRAFTS,
                                        AcceptanceMode.TOPK_DRAFTS])
def test_moa_sampling_through_the_server(moa_server, acceptance, tmp_path, monkeypatch):
    """Sampled MoA drafts go out with their q; both rules accept drafts and finish."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    options = ClientOptions("moa", 16, MAX_NEW, SamplingParams(temperature=0.8, seed=3),
                            acceptance)
    results = run(moa_server.address, options)
    assert all(r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN) for r in results)
    assert sum(r.accepted_tokens for r in results) > 0, "no sampled draft was accepted"


def test_bundle_fetch_deadline_grows_with_its_size(moa_server):
    """A slow link gets the time the bundle's size needs; a deadline below that fails."""
    import hashlib

    from edge_client.link import LinkConfig, ServerLink

    bundle = next(a for a in moa_server.service.info().artifacts
                  if a.kind is ArtifactKind.DRAFTER_BUNDLE)
    mbit = bundle.size_bytes * 8 / 1e6  # about one second of transfer
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=0, bandwidth_mbit=mbit))

    async def fetch(address: str, min_rate: float) -> bytes:
        config = LinkConfig(fetch_timeout_s=0.2, fetch_min_rate=min_rate)
        async with ServerLink(address, config) as link:
            return await link.fetch_artifact(bundle.name, bundle.sha256, bundle.size_bytes)

    with ProxyThread(moa_server.address, conditions) as proxy:
        data = asyncio.run(fetch(proxy.address, bundle.size_bytes / 4))  # 4.2 s allowed
        assert hashlib.sha256(data).hexdigest() == bundle.sha256
        with pytest.raises(LinkError):
            asyncio.run(fetch(proxy.address, bundle.size_bytes * 5))  # 0.4 s allowed


def test_a_download_that_fills_the_link_for_seconds_survives_keepalive(moa_server):
    """The bundle takes ~3 s on this link, and a ping's answer waits behind it in the queue,
    past the generation channel's 1 s ping timeout: the download's own channel waits it out
    (shared/keepalive.py). Measured before: every download on 3G failed this way."""
    from edge_client.link import ServerLink

    bundle = next(a for a in moa_server.service.info().artifacts
                  if a.kind is ArtifactKind.DRAFTER_BUNDLE)
    mbit = bundle.size_bytes * 8 / 1e6 / 3
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=20, bandwidth_mbit=mbit))

    async def fetch(address: str) -> bytes:
        async with ServerLink(address) as link:
            return await link.fetch_artifact(bundle.name, bundle.sha256, bundle.size_bytes)

    with ProxyThread(moa_server.address, conditions) as proxy:
        assert len(asyncio.run(fetch(proxy.address))) == bundle.size_bytes


def test_auto_has_no_sampling_rule_until_resolved():
    """A sampled request is built from an entered client's options, where 'auto' is resolved."""
    with pytest.raises(ValueError, match="auto"):
        ClientOptions("auto", sampling=SamplingParams(temperature=0.8)).open_request(
            prompt_ids=PROMPTS[0])
    moa = ClientOptions("moa", sampling=SamplingParams(temperature=0.8))
    assert moa.open_request(prompt_ids=PROMPTS[0]).acceptance is AcceptanceMode.TOPK_DRAFTS
