"""The server half's activation rows in paced sessions, through the real server and client on
the tiny target with the MoA drafter: a prompt's rows trail its Verdict in parts under flow
control, an edge whose drafts come too late rests and pauses them, a resume gets the rows a
broken stream lost, and a client that reads nothing yet holds no forward back."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from cloud_server.config import ServerConfig
from cloud_server.decoding.session import Session
from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions
from edge_client.drafters.moa import MoaDrafter
from edge_client.link import ServerLink
from netsim import LinkProfile, NetworkConditions, ProxyThread
from shared.messages import (
    ActivationFormat, ActivationRows, FinishReason, Limits, OpenRequest, Pace, Resume, Verdict,
)
from testkit.moa_runs import LIMITS, MAX_NEW, PROMPTS, run
from testkit.waiting import until, until_let_go
from tests.server_harness import ServerThread


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
    from cloud_server.rpc import session_streams, stream_buffers

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
    from cloud_server.rpc import session_streams, stream_buffers
    from cloud_server.rpc.client_stream import ClientStream
    from cloud_server.decoding.server_decoding import ServerDecoder
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
    from cloud_server.decoding.server_decoding import ServerDecoder
    from cloud_server.rpc.session_streams import SessionStreams
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
    computes none meanwhile (cloud_server/decoding/activation_rows.py) and the first Verdict after
    carries them all, from one call of the server half: the edge's drafter gets every row, in
    order, and the text stays exact. (Computed after each forward, no call would cover more
    than the pending token and the 4 nodes a forward verifies here.)"""
    from cloud_server.decoding.activation_rows import RowKeeper
    from cloud_server.decoding.server_decoding import ServerDecoder
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
    from cloud_server.rpc import session_streams

    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    prompt = tuple(range(40, 100))
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16, lead=1, trailing_rows=True)

    async def go(server: ServerThread) -> tuple[Verdict, list[ActivationRows]]:
        async with ServerLink(server.address) as link:
            stream = link.decode()
            await stream.send(request)
            opened, first = await stream.recv(), await stream.recv()
            assert first.activations is None
            stream.cancel()
            await until_let_go(server.service.sessions, opened.session_id)
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
        again, rows = asyncio.run(go(server))
    assert rows[0].start == 0
    assert sum(len(r.values) for r in rows) >= len(prompt)  # and what the server ran ahead


def test_a_client_that_reads_nothing_yet_holds_no_forward_back(tiny_target, tiny_drafter_dir,
                                                              monkeypatch):
    """The prompt's rows fill the stream's flow-control window (a slow link does the same) and
    the client has not read them yet: the server still runs its forwards, up to the lead."""
    from cloud_server.decoding.forward_builder import ForwardBuilder

    forwards: list[int] = []  # the committed length each forward started from
    sessions: list[Session] = []
    real = ForwardBuilder.stepping
    monkeypatch.setattr(ForwardBuilder, "stepping", lambda self, *args: (
        forwards.append(len(self.session.committed)), sessions.append(self.session),
        real(self, *args))[2])
    prompt = tuple(40 + i % 60 for i in range(900))  # 900 fp16 rows of width 64: 115 KB
    lead = 6
    acknowledged = len(prompt) + 1  # the prefill's token counts as received
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16, lead=lead, trailing_rows=True)

    async def go(server: ServerThread) -> list[int]:
        async with ServerLink(server.address) as link:
            stream = link.decode()
            await stream.send(request)  # and reads nothing
            await until(lambda: bool(sessions) and (
                sessions[0].finished or len(sessions[0].committed) >= acknowledged + lead),
                60, "the server's forwards to reach the lead")
            ran = list(forwards)
            stream.cancel()
            return ran
    limits = replace(LIMITS, max_prompt_tokens=1000)
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_drafter_dir)) as server:
        assert len(prompt) * server.service.info().activation_width * 2 > 65536
        ran = asyncio.run(go(server))
    assert ran and ran[0] == acknowledged and ran[-1] < acknowledged + lead


def test_a_client_that_does_not_read_trailing_rows_gets_them_inside(tiny_target, tiny_drafter_dir,
                                                                   monkeypatch):
    """An Open without trailing_rows (a client older than them) gets a paced Verdict with its
    rows inside, as in lock-step."""
    from cloud_server.rpc import session_streams

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
