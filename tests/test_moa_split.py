"""The MoA drafter through the real server and client on the tiny target: the server offers
the bundle, the edge fetches and caches it, Verdicts carry the server half's activations, and
greedy split decoding stays identical to plain greedy decoding, through an outage too."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cloud_server.reference import compare, plain_greedy
from edge_client import client as edge_client_module
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafter_source import DrafterPool
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_bundle import bundle_cache_dir
from edge_client.drafters.trained import trained_drafter
from edge_client.link import LinkError, ServerLink
from shared.acceptance import AcceptanceMode
from shared.messages import (
    ActivationFormat, ArtifactKind, FinishReason, Limits, Next, OpenRequest, Pace,
)
from netsim import LinkProfile, NetworkConditions, OutageMode, ProxyThread
from shared.drafting.aded import AdedDrafter
from shared.drafting.base import DrafterName
from shared.sampling import SamplingParams
from cloud_server.config import ServerConfig
from cloud_server.decoding.pacing import AutoPace
from testkit.moa_runs import LIMITS, MAX_NEW, PROMPTS, run
from testkit.oracle_drafters import SupportOracle, TargetCopy, TwinBranchOracle
from testkit.waiting import Progress
from tests.server_harness import ServerThread

@pytest.fixture(scope="module")
def target_copy(tiny_model_dir) -> TargetCopy:
    return TargetCopy(tiny_model_dir)


def lend(monkeypatch, make) -> None:
    """Every EdgeClient entered from now on drafts with a fresh `make()` (testkit's oracles,
    whose drafts are right by construction) instead of the drafter its options name."""
    async def pool(*args, **kwargs) -> DrafterPool:
        return DrafterPool(make)
    monkeypatch.setattr(edge_client_module, "drafter_pool", pool)


def server_half_rows(target, drafter_dir, ids) -> np.ndarray:
    """[len(ids), width]: the server half's activations of every position of `ids`, computed
    here in fp32 from one forward of the whole text."""
    from cloud_server.moa.activations import ServerActivations

    source = ServerActivations.load(drafter_dir, target.model)
    assert not source.hidden_layers  # it reads the cache (the root drafter: layer K/V)
    with torch.inference_mode():
        cache = target.model(input_ids=torch.tensor([list(ids)], device=target.device),
                             use_cache=True).past_key_values
    return source(cache, 0, len(ids), dtype=np.float32)


@pytest.mark.parametrize("fmt, pace", [(ActivationFormat.FP16, Pace.LOCKSTEP),
                                       (ActivationFormat.INT8, Pace.LOCKSTEP),
                                       (ActivationFormat.FP16, Pace.AUTO),
                                       (ActivationFormat.INT8, Pace.SERVER)])
def test_moa_split_greedy_equals_plain(moa_server, tiny_target, tiny_drafter_dir, fmt, pace,
                                       tmp_path, monkeypatch):
    """Lossless at every pace and activation format, and the rows the edge's drafter is fed
    are the server half's activations of the positions they claim, within the format's
    rounding (what the drafter drafts from them is the trained network's business)."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    fed: list[list[tuple[int, np.ndarray]]] = []  # per generation: (start, rows) as fed
    add = MoaDrafter.add_activations

    def recorded(self, start: int, activations: np.ndarray) -> None:
        fed[-1].append((start, np.array(activations, dtype=np.float32)))
        add(self, start, activations)
    monkeypatch.setattr(MoaDrafter, "add_activations", recorded)

    async def go():
        async with EdgeClient(moa_server.address, ClientOptions(
                "moa", 16, MAX_NEW, activation_format=fmt, pace=pace)) as client:
            results = []
            for prompt in PROMPTS:
                fed.append([])
                results.append(await client.generate(client.options.open_request(
                    prompt_ids=prompt)))
            return results

    results = asyncio.run(go())
    # int8 keeps a row to half a step of max|row| / 127; fp16 to 2^-11 of each value
    tolerance = 1 / 100 if fmt is ActivationFormat.INT8 else 1 / 500
    for prompt, result, rows in zip(PROMPTS, results, fed):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
        want = server_half_rows(tiny_target, tiny_drafter_dir, [*prompt, *result.output_ids])
        for start, got in rows:
            # the last round's rows may run past the text, over drafts the length limit cut
            got = got[:max(0, len(want) - start)]
            expected = want[start:start + len(got)]
            scale = np.abs(expected).max(axis=1, keepdims=True)  # [n, 1]
            assert (np.abs(got - expected) <= tolerance * scale + 1e-4).all(), start
    # Lock-step asks for a draft from every Verdict's rows: every position but the last
    # token's was fed; paced, at least the prompt's once a Verdict asked for a draft (auto
    # rests from the first Verdict where the Open's round trip outweighs the tiny target's
    # step, as a loaded machine's can: then no rows cross)
    first = set().union(*(range(start, start + len(got)) for start, got in fed[0]))
    text = len(PROMPTS[0]) + len(results[0].output_ids)
    if pace is Pace.LOCKSTEP or first:
        assert first >= set(range(text - 1 if pace is Pace.LOCKSTEP else len(PROMPTS[0])))
    bundle = next(a for a in moa_server.service.info().artifacts
                  if a.kind is ArtifactKind.DRAFTER_BUNDLE)
    assert bundle_cache_dir(bundle.sha256).is_dir()  # fetched once, cached by sha256


@pytest.mark.parametrize("pace", [Pace.LOCKSTEP, Pace.SERVER])
def test_draft_graphs_travel_folded_and_stay_lossless(tiny_target, tiny_drafter_dir,
                                                      target_copy, pace, tmp_path, monkeypatch):
    """--draft-graphs: the drafts reach the server with aliases (each repeated subtree once),
    it unrolls them, and the text equals plain greedy. The MoA drafter merging repeats stays
    lossless; whether its trees repeat a subtree is up to the trained network, so the aliases
    come from an oracle whose every tree repeats one that the right path runs through."""
    from shared import wire

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    aliases: list[int] = []  # per draft with room for a repeat that reached the server
    decode = wire.client_from_proto

    def counted(raw, max_tree_nodes):
        # the oracle repeats a subtree only with two levels of room: a paced server's node
        # budget (Verdict.draft_nodes) may leave it one, two nodes; an acknowledgement has none
        if raw.HasField("draft") and len(raw.draft.tokens) > 2:
            aliases.append(len(raw.draft.alias_nodes))
        return decode(raw, max_tree_nodes)

    monkeypatch.setattr(wire, "client_from_proto", counted)
    limits = Limits(max_tree_nodes=48, max_tree_depth=8, max_new_tokens=64)
    config = ServerConfig(limits, drafter_dir=tiny_drafter_dir / "last")
    oracles: list[TwinBranchOracle] = []

    def oracle() -> TwinBranchOracle:
        oracles.append(TwinBranchOracle(target_copy, limits.max_tree_depth))
        return oracles[-1]

    # paced, a short lead holds the server to the client's acknowledgements, which carry its
    # drafts: with the default lead a loaded machine let the server finish before any came
    options = ClientOptions("moa", 48, MAX_NEW, pace=pace, lead=2, draft_graphs=True)
    with ServerThread(tiny_target, config) as server:
        by_moa = run(server.address, options)
        lend(monkeypatch, oracle)
        aliases.clear()
        by_oracle = run(server.address, options)
    for results in (by_moa, by_oracle):
        for prompt, result in zip(PROMPTS, results):
            plain = plain_greedy(tiny_target, prompt, MAX_NEW)
            assert compare(tiny_target, prompt, result.output_ids, plain).lossless
    # each generation's first draft has one; lock-step always sends it, while a paced
    # server on a loaded machine may finish before any draft reaches it (1 run in 4 beside
    # two busy cores)
    if pace is Pace.LOCKSTEP or aliases:
        assert sum(aliases) > 0, aliases
    if pace is Pace.LOCKSTEP:  # every draft is verified; paced, the server may run past them
        # without the unrolled subtree a round accepts g1 and g2 at most
        assert max(n for o in oracles for n in o.accepted) > 2, [o.accepted for o in oracles]


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


@pytest.mark.parametrize("rested", [False, True], ids=["drafting", "at-rest-from-the-start"])
def test_moa_keeps_drafting_through_an_outage(moa_server, tiny_target, tiny_bundle, tmp_path,
                                              monkeypatch, rested):
    """At rest from the first Verdict the server sends no rows, so MoA (here without prompt
    lookup, which could draft from the text) has nothing to draft from: the edge drafts
    offline from the text alone (generation_drafts._offline_drafter)."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    asked: list[int] = []  # contexts the text-only fallback was asked to continue
    if rested:
        monkeypatch.setattr(AutoPace, "decide", lambda self, busy: Next.REST)
        lend(monkeypatch, lambda: trained_drafter(tiny_bundle, DrafterName.MOA, lookup_nodes=0))
        propose = AdedDrafter.propose

        def recorded(self, context, max_nodes):
            asked.append(len(context))
            return propose(self, context, max_nodes)
        monkeypatch.setattr(AdedDrafter, "propose", recorded)
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=15),
                                             outage_mode=OutageMode.CUT)
    request = OpenRequest(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW,
                          pace=Pace.AUTO if rested else None)

    async def go(proxy: ProxyThread):
        async with EdgeClient(proxy.address, ClientOptions("moa", 1, MAX_NEW)) as client:
            progress = Progress()
            task = asyncio.create_task(client.generate(request, progress))
            await progress.reached(2)  # the prefill's token and a round's: mid-generation
            proxy.start_outage(1.0)
            return await asyncio.wait_for(task, 60)

    with ProxyThread(moa_server.address, conditions) as proxy:
        result = asyncio.run(go(proxy))
    plain = plain_greedy(tiny_target, PROMPTS[0], MAX_NEW)
    assert compare(tiny_target, PROMPTS[0], result.output_ids, plain).lossless
    assert result.reconnects >= 1
    if rested:  # what ADED drafts depends on the text: after a token never followed, nothing
        assert asked and result.drafts.settled == 0
    else:
        assert result.offline_tokens > 0 and result.drafts.settled > 0


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
def test_moa_sampling_through_the_server(moa_server, target_copy, acceptance, tmp_path,
                                         monkeypatch):
    """MoA drafts go out under both sampling rules, sampled ones with their q, and the text
    finishes; both rules accept drafts: every round accepts one of an oracle's, which drafts
    the whole support of the target's p (how many of MoA's get accepted is up to the trained
    network and, at temperature 0.8 on the tiny target, to chance)."""
    from shared import wire

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    with_q: list[int] = []  # of each draft received with nodes: how many nodes have q
    decode = wire.client_from_proto

    def recorded(raw, max_tree_nodes):
        msg = decode(raw, max_tree_nodes)
        if raw.HasField("draft") and len(msg.tree):
            with_q.append(len(msg.q))
        return msg

    monkeypatch.setattr(wire, "client_from_proto", recorded)
    options = ClientOptions("moa", 16, MAX_NEW, SamplingParams(temperature=0.8, seed=3),
                            acceptance)
    results = run(moa_server.address, options)
    assert all(r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN) for r in results)
    assert with_q and sum(r.drafted_tokens for r in results) > 0
    if acceptance is AcceptanceMode.SAMPLED_DRAFTS:
        assert all(with_q)
    else:
        assert not any(with_q)

    top8 = SamplingParams(temperature=0.8, top_k=8, seed=3)  # a support the oracle drafts whole
    lend(monkeypatch, lambda: SupportOracle(target_copy, top8, LIMITS.max_tree_depth))
    results = run(moa_server.address, ClientOptions("moa", 16, MAX_NEW, top8, acceptance))
    assert all(r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN) for r in results)
    rounds, accepted = sum(r.rounds for r in results), sum(r.accepted_tokens for r in results)
    # by construction every round accepts one; a tenth spared for a top-k near-tie, where this
    # copy's support may differ from the server's by a token
    assert accepted >= 0.9 * rounds > 0, (accepted, rounds)


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


def drafted_with_pld(address: str, tiny_target, capsys) -> str:
    """Generates PROMPTS[0] asking for the MoA drafter; checks the edge fell back to prompt
    lookup with the target's text and said so in one line, which it returns."""
    async def go():
        async with EdgeClient(address, ClientOptions("moa", 16, MAX_NEW)) as client:
            result = await client.generate(client.options.open_request(prompt_ids=PROMPTS[0]))
            return client.options.drafter, result

    drafter, result = asyncio.run(go())
    assert drafter is DrafterName.PLD
    assert compare(tiny_target, PROMPTS[0], result.output_ids,
                   plain_greedy(tiny_target, PROMPTS[0], MAX_NEW)).lossless
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot" in line]
    assert len(said) == 1 and "pld" in said[0], said
    return said[0]


def test_an_edge_that_cannot_run_the_bundle_drafts_with_prompt_lookup(moa_server, tiny_target,
                                                                      tmp_path, monkeypatch,
                                                                      capsys):
    """An onnxruntime too old for the bundle's graphs: one line saying so and what to do, then
    the generation goes on with prompt lookup, its text still the target's."""
    import onnxruntime as ort

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))

    def too_old(*args, **kwargs):
        raise ort.capi.onnxruntime_pybind11_state.Fail("[ONNXRuntimeError] : 1 : FAIL : "
                                                       "unknown operator\nsecond line")
    monkeypatch.setattr(ort, "InferenceSession", too_old)
    assert "update onnxruntime" in drafted_with_pld(moa_server.address, tiny_target, capsys)


def test_a_bundle_built_for_another_target_is_refused(moa_server, tiny_bundle):
    """Its ids and activations would mean something else: one line, then prompt lookup."""
    from dataclasses import replace

    from edge_client.drafter_source import for_target
    from shared.drafter_bundle import BundleError

    info = moa_server.service.info()
    assert for_target(tiny_bundle, info) == tiny_bundle
    with pytest.raises(BundleError, match="built for tiny-llama, not its target other-model"):
        for_target(tiny_bundle, replace(info, model_id="other-model"))


def test_a_bundle_cut_short_leaves_the_generation_to_prompt_lookup(moa_server, tiny_target,
                                                                   tmp_path, monkeypatch,
                                                                   capsys):
    """A download that fails its sha256 check (or its deadline): one line, then prompt
    lookup; nothing cached, so the next run fetches it again."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))

    whole = ServerLink.fetch_artifact

    async def cut_short(self, name, sha256, size_bytes=0):
        if not name.startswith("drafter"):  # the tokenizer arrives
            return await whole(self, name, sha256, size_bytes)
        raise LinkError(f"artifact {name} from {self.address} failed its sha256 check")
    monkeypatch.setattr(ServerLink, "fetch_artifact", cut_short)
    assert "did not arrive whole" in drafted_with_pld(moa_server.address, tiny_target, capsys)
    assert not list((tmp_path / "drafters").glob("*"))
