"""The MoA drafter through the real server and client on the tiny target: the server offers
the bundle, the edge fetches and caches it, Verdicts carry the server half's activations, and
greedy split decoding stays identical to plain greedy decoding, through an outage too."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_bundle import bundle_cache_dir
from edge_client.link import LinkError, ServerLink
from shared.acceptance import AcceptanceMode
from shared.messages import (
    ActivationFormat, ActivationRows, ArtifactKind, FinishReason, Limits, OpenRequest, Pace,
    Resume, Verdict,
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


def test_activations_past_the_message_limit_arrive_in_parts(tiny_target, tiny_drafter_dir,
                                                            tmp_path, monkeypatch):
    """A prompt whose activations pass the server's message limit: the Verdict goes in parts,
    the client joins them, and the drafter gets every row (greedy text still exact)."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64,
                    max_message_bytes=4096)
    prompt = tuple(range(40, 100))  # 60 rows of fp16 activations: several KiB
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server:
        width = server.service.info().activation_width
        assert 60 * width * 2 > limits.max_message_bytes
        result, = run(server.address, ClientOptions("moa", 8, MAX_NEW), prompts=[prompt])
    plain = plain_greedy(tiny_target, prompt, MAX_NEW)
    assert compare(tiny_target, prompt, result.output_ids, plain).lossless


def _recording_trailing(monkeypatch) -> list[list]:
    """What the server's wire.trailing returned for each paced Verdict it sent."""
    from shared import wire

    sent: list[list] = []
    real = wire.trailing

    def trailing(*args):
        sent.append(real(*args))
        return sent[-1]
    monkeypatch.setattr(wire, "trailing", trailing)
    return sent


@pytest.mark.parametrize("pace, in_flight", [(Pace.SERVER, 32 * 1024), (Pace.AUTO, 32 * 1024),
                                             (Pace.SERVER, 1024)])
def test_a_paced_prompts_activations_trail_its_verdict(tiny_target, tiny_drafter_dir, pace,
                                                       in_flight, tmp_path, monkeypatch):
    """A paced session sends the prompt's many activation rows after the prefill's Verdict, in
    messages within the message limit, so its first token does not queue behind them on the
    link; the edge's drafter gets every row, in order, and the text is exact. The edge
    acknowledges the rows it holds; with 1 KiB in flight each part waits for that."""
    from cloud_server import session_streams, stream_buffers

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    monkeypatch.setattr(session_streams, "ROWS_IN_FLIGHT_BYTES", in_flight)
    acknowledged: list[int] = []
    real_held = stream_buffers.Outbox.held
    monkeypatch.setattr(stream_buffers.Outbox, "held", lambda self, rows, paused=False: (
        acknowledged.append(rows), real_held(self, rows, paused))[-1])
    sent = _recording_trailing(monkeypatch)
    added: list[tuple[int, int]] = []  # (start, rows) as the edge's drafter got them
    real_add = MoaDrafter.add_activations
    monkeypatch.setattr(MoaDrafter, "add_activations", lambda self, start, values: (
        added.append((start, len(values))), real_add(self, start, values))[-1])
    limits = replace(LIMITS, max_message_bytes=4096)
    prompt = tuple(range(40, 100))
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server:
        assert 60 * server.service.info().activation_width * 2 > limits.max_message_bytes
        result, = run(server.address, ClientOptions("moa", 8, MAX_NEW, pace=pace),
                      prompts=[prompt])
    head, *rows = sent[0]
    assert isinstance(head, Verdict) and head.activations is None and head.tokens
    assert len(rows) >= 2 and all(isinstance(r, ActivationRows) for r in rows)
    assert [r.start for r in rows] == list(np.cumsum([0] + [len(r.values) for r in rows[:-1]]))
    assert sum(len(r.values) for r in rows) == len(prompt)
    assert added[: len(rows)] == [(r.start, len(r.values)) for r in rows]
    assert len(prompt) in acknowledged
    assert compare(tiny_target, prompt, result.output_ids,
                   plain_greedy(tiny_target, prompt, MAX_NEW)).lossless


def test_an_edge_whose_drafts_the_server_overtakes_rests_and_stops_the_rows(
        tiny_target, tiny_drafter_dir, tmp_path, monkeypatch):
    """Right one-token drafts over a link slower than the server, which drafts nothing of its
    own: it commits past each draft before the draft arrives. After a few the edge drafts only
    now and then, pauses the rows, so the server sends none, and answers the Verdicts only
    now and then (the server's lead is far). Its probes earn nothing, so the rows it missed
    never come; those it got came in order, and the text stays exact."""
    from cloud_server import session_streams, stream_buffers
    from cloud_server.client_stream import ClientStream
    from cloud_server.server_decoding import ServerDecoder
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(session_streams, "ROWS_IN_FLIGHT_BYTES", 512)  # 4 rows of the tiny model
    max_new = 64
    prompt = PROMPTS[0]
    plain = plain_greedy(tiny_target, prompt, max_new)
    proposed: list[int] = []
    monkeypatch.setattr(MoaDrafter, "propose", lambda self, context, nodes: (
        proposed.append(len(context)),
        DraftTree.chain(plain[len(context) - len(prompt):][:1]))[1])
    monkeypatch.setattr(ServerDecoder, "propose",
                        lambda self, context: Proposal(DraftTree.chain([])))
    answers: list[tuple[int, bool]] = []  # (committed length, rows paused) as received
    real_put = stream_buffers.Inbox.put
    monkeypatch.setattr(stream_buffers.Inbox, "put", lambda self, draft, committed: (
        answers.append((draft.base_length, draft.rows_paused)),
        real_put(self, draft, committed))[-1])
    added: list[tuple[int, int]] = []
    real_add = MoaDrafter.add_activations
    monkeypatch.setattr(MoaDrafter, "add_activations", lambda self, start, values: (
        added.append((start, len(values))), real_add(self, start, values))[-1])
    alone: list[int] = []  # Verdicts the server sent without their rows, which waited
    real_send = ClientStream.send
    monkeypatch.setattr(ClientStream, "send", lambda self, msg: (
        isinstance(msg, Verdict) and msg.activations is None
        and msg.finish_reason is FinishReason.NOT_FINISHED
        and alone.append(msg.committed_length), real_send(self, msg))[-1])
    limits = replace(LIMITS, max_new_tokens=max_new)
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=25))
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server, \
            ProxyThread(server.address, slow) as proxy:
        result, = run(proxy.address, ClientOptions("moa", 4, max_new, pace=Pace.SERVER),
                      prompts=[prompt])
    assert result.output_ids == plain and result.accepted_tokens == 0
    assert len(proposed) < max_new / 4  # it rested
    paused = [p for _, p in answers]
    assert any(paused) and all(paused[paused.index(True):])  # its probes took no rows
    assert len(answers) < max_new / 2  # and, resting, answered only now and then
    assert len(alone) > 16
    assert all(a + n == b for (a, n), (b, _) in zip(added, added[1:]))  # caught up in order


def test_the_next_generation_on_a_link_too_slow_for_drafts_opens_resting(
        tiny_target, tiny_drafter_dir, tmp_path, monkeypatch):
    """As above, with three generations on one client, which carries a rest one generation
    (CARRY_GENERATIONS). The second opens resting (Open.rows_paused): no rows cross the link,
    not even its prompt's, and it drafts only at probes. The third learns the link afresh.
    Every text stays exact."""
    from cloud_server.server_decoding import ServerDecoder
    from cloud_server.session_streams import SessionStreams
    from edge_client import paced_drafts
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(paced_drafts, "CARRY_GENERATIONS", 1)
    max_new = 48
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    plains = [plain_greedy(tiny_target, p, max_new) for p in prompts]
    log: list[tuple] = []  # ("open", rows paused) | ("rows",) | ("draft",) as they happen

    def propose(self, context, nodes):
        log.append(("draft",))
        prompt, plain = next((p, t) for p, t in zip(prompts, plains) if tuple(context[:5]) == p)
        return DraftTree.chain(plain[len(context) - len(prompt):][:1])
    monkeypatch.setattr(MoaDrafter, "propose", propose)
    monkeypatch.setattr(ServerDecoder, "propose",
                        lambda self, context: Proposal(DraftTree.chain([])))
    real_serve = SessionStreams.decode
    monkeypatch.setattr(SessionStreams, "decode",
                        lambda self, session, stream, owner, first, paused: (
                            log.append(("open", paused)),
                            real_serve(self, session, stream, owner, first, paused))[-1])
    real_add = MoaDrafter.add_activations
    monkeypatch.setattr(MoaDrafter, "add_activations", lambda self, start, values: (
        log.append(("rows",)), real_add(self, start, values))[-1])
    limits = replace(LIMITS, max_new_tokens=max_new)
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=25))
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server, \
            ProxyThread(server.address, slow) as proxy:
        results = run(proxy.address, ClientOptions("moa", 4, max_new, pace=Pace.SERVER),
                      prompts=prompts)
    assert [r.output_ids for r in results] == plains
    opens = [i for i, e in enumerate(log) if e[0] == "open"]
    assert [log[i] for i in opens] == [("open", False), ("open", True), ("open", False)]
    first, second, third = log[opens[0]:opens[1]], log[opens[1]:opens[2]], log[opens[2]:]
    assert ("rows",) in first and ("rows",) not in second and ("rows",) in third
    assert second.count(("draft",)) < first.count(("draft",))  # probes only
    assert results[1].bytes_down < results[0].bytes_down / 2


def test_rows_an_edge_paused_come_in_one_piece_when_it_asks_again(
        moa_server, tiny_target, tmp_path, monkeypatch):
    """The edge pauses the rows for a stretch of the answer, then asks again. The server
    computes none meanwhile (cloud_server/activation_rows.py) and the first Verdict after
    carries them all, from one call of the server half: the edge's drafter gets every row, in
    order, and the text stays exact. (Computed after each forward, no call would cover more
    than the pending token and the 4 nodes a forward verifies here.)"""
    from cloud_server.activation_rows import RowKeeper
    from cloud_server.server_decoding import ServerDecoder
    from edge_client.generate import SplitGeneration
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ServerDecoder, "propose",
                        lambda self, context: Proposal(DraftTree.chain([])))
    prompt, max_new = PROMPTS[0], 48
    pause = range(len(prompt) + 8, len(prompt) + 28)  # committed lengths the edge rests at
    real_answer = SplitGeneration._answer

    async def answer(self, stream, follower, awaited):
        follower.spacing._resting = len(self.context) in pause
        await real_answer(self, stream, follower, awaited)
    monkeypatch.setattr(SplitGeneration, "_answer", answer)
    computed: list[tuple[int, int]] = []
    real_compute = RowKeeper._compute
    monkeypatch.setattr(RowKeeper, "_compute", lambda self, cache: (
        self._pending and computed.append((self._pending[0][0], self._pending[-1][1])),
        real_compute(self, cache))[-1])
    added: list[tuple[int, int]] = []
    real_add = MoaDrafter.add_activations
    monkeypatch.setattr(MoaDrafter, "add_activations", lambda self, start, values: (
        added.append((start, len(values))), real_add(self, start, values))[-1])
    options = ClientOptions("moa", 4, max_new, pace=Pace.SERVER, lead=4)
    result, = run(moa_server.address, options, prompts=[prompt])
    assert result.output_ids == plain_greedy(tiny_target, prompt, max_new)
    assert max(end - start for start, end in computed) > 8
    assert added[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(added, added[1:]))
    assert sum(n for _, n in added) >= pause.stop  # past the pause, nothing missing


def test_a_resume_gets_the_trailing_rows_its_broken_stream_lost(tiny_target, tiny_drafter_dir,
                                                                monkeypatch):
    """The stream breaks after the prefill's Verdict, before the prompt's rows that trail it:
    the resume says it holds none (Resume.rows_held) and gets them all again."""
    from cloud_server import session_streams

    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    prompt = tuple(range(40, 100))
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16, lead=1, trailing_rows=True)

    async def go(address: str) -> tuple[Verdict, list[ActivationRows]]:
        async with ServerLink(address) as link:
            stream = link.decode()
            await stream.send(request)
            opened, first = await stream.recv(), await stream.recv()
            assert first.activations is None
            stream.cancel()
            await asyncio.sleep(0.2)  # the server notices the stream is gone
            stream = link.decode()
            await stream.send(replace(request, resume=Resume(opened.session_id, first.tokens,
                                                             rows_held=0)))
            assert (await stream.recv()).resumed
            again, rows = await stream.recv(), []
            while isinstance(msg := await stream.recv(), ActivationRows):
                rows.append(msg)
            stream.cancel()
            return again, rows

    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        again, rows = asyncio.run(go(server.address))
    assert rows[0].start == 0
    assert sum(len(r.values) for r in rows) >= len(prompt)  # and what the server ran ahead


def test_a_client_that_reads_nothing_yet_holds_no_forward_back(tiny_target, tiny_drafter_dir,
                                                              monkeypatch):
    """The prompt's rows fill the stream's flow-control window (a slow link does the same) and
    the client has not read them yet: the server still runs its forwards, up to the lead."""
    from cloud_server.forward_builder import ForwardBuilder

    forwards: list[int] = []  # the committed length each forward started from
    real = ForwardBuilder.stepping
    monkeypatch.setattr(ForwardBuilder, "stepping", lambda self, *args: (
        forwards.append(len(self.session.committed)), real(self, *args))[1])
    prompt = tuple(40 + i % 60 for i in range(900))  # 900 fp16 rows of width 64: 115 KB
    lead = 6
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16, lead=lead, trailing_rows=True)

    async def go(server: ServerThread) -> list[int]:
        async with ServerLink(server.address) as link:
            stream = link.decode()
            await stream.send(request)
            await asyncio.sleep(2.0)  # reading nothing
            ran = list(forwards)
            stream.cancel()
            return ran
    limits = replace(LIMITS, max_prompt_tokens=1000)
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server:
        assert len(prompt) * server.service.info().activation_width * 2 > 65536
        ran = asyncio.run(go(server))
    acknowledged = len(prompt) + 1  # the prefill's token counts as received
    assert ran and ran[0] == acknowledged and ran[-1] < acknowledged + lead


def test_a_client_that_does_not_read_trailing_rows_gets_them_inside(tiny_target, tiny_drafter_dir,
                                                                   monkeypatch):
    """An Open without trailing_rows (a client older than them) gets a paced Verdict with its
    rows inside, as in lock-step."""
    from cloud_server import session_streams

    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    prompt = tuple(range(40, 100))
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=4, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16)

    async def go(address: str) -> list:
        async with ServerLink(address) as link:
            stream = link.decode()
            await stream.send(request)
            messages = [await stream.recv() for _ in range(3)]
            stream.cancel()
            return messages
    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        opened, first, second = asyncio.run(go(server.address))
    assert len(first.activations.values) == len(prompt) and isinstance(second, Verdict)
