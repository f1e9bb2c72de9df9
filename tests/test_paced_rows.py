"""The server half's activation rows in paced sessions, through the real server and client on
the tiny target with the MoA drafter: a prompt's rows trail its Verdict in parts under flow
control, none cross while the server tells the edge to rest (Verdict.next) and those after come
in order from where they stopped, a client on a link too slow for drafts rests from the first
Verdict, a resume gets the rows a broken stream lost, and a client that reads nothing yet holds
no forward back."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Callable

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
    ActivationFormat, ActivationRows, DraftRequest, Limits, Next, OpenRequest, Pace, Resume,
    Verdict,
)
from shared.tree import DraftTree
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
    if pace is Pace.AUTO:  # told to draft, as on a link fast enough for drafts to pay
        _deciding(monkeypatch, lambda n: Next.DRAFT)
    acknowledged: list[int] = []
    real_held = stream_buffers.Outbox.held
    monkeypatch.setattr(stream_buffers.Outbox, "held", lambda self, rows: (
        acknowledged.append(rows), real_held(self, rows))[-1])
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


def _deciding(monkeypatch, says: Callable[[int], Next]) -> list[Next]:
    """Auto pace's n-th decision (from 1, over every session) made `says(n)`; what it waits
    for and measures stays its own. Returns the decisions as they are made."""
    from cloud_server.decoding.pacing import AutoPace

    decided: list[Next] = []
    real = AutoPace.decide

    def decide(self, busy: bool) -> Next:
        real(self, busy)
        decided.append(says(len(decided) + 1))
        return decided[-1]
    monkeypatch.setattr(AutoPace, "decide", decide)
    return decided


def _logging_the_server(monkeypatch, log: list[tuple]) -> None:
    """Logs, in the order the server's event loop does them, auto's decisions, what the
    session's stream writes ("verdict", next, committed length, rows inside) or ("rows",
    start, count), and the client's answers ("draft", base length, nodes)."""
    from cloud_server.decoding.pacing import AutoPace
    from cloud_server.rpc import stream_buffers
    from cloud_server.rpc.client_stream import ClientStream

    real_decide = AutoPace.decide

    def decide(self, busy: bool) -> Next:
        log.append(("decide", real_decide(self, busy)))
        return log[-1][1]
    monkeypatch.setattr(AutoPace, "decide", decide)
    real_send = ClientStream.send

    async def send(self, msg) -> None:
        if isinstance(msg, Verdict):
            log.append(("verdict", msg.next, msg.committed_length, msg.activations is not None))
        elif isinstance(msg, ActivationRows):
            log.append(("rows", msg.start, len(msg.values)))
        await real_send(self, msg)
    monkeypatch.setattr(ClientStream, "send", send)
    real_put = stream_buffers.Inbox.put
    monkeypatch.setattr(stream_buffers.Inbox, "put", lambda self, draft, committed: (
        log.append(("draft", draft.base_length, len(draft.tree))),
        real_put(self, draft, committed))[-1])


def test_while_auto_says_rest_no_rows_cross_and_those_after_come_from_where_they_stopped(
        moa_server, tiny_target, tmp_path, monkeypatch):
    """Auto pace tells the edge to rest for a stretch of the answer (forwards 4 to 15), then
    asks for drafts again. While it rests, the server writes no activation rows, computes
    none (cloud_server/decoding/activation_rows.py), and the edge drafts nothing; the first
    Verdict after carries the rows the rest held back, from one call of the server half, and
    the edge's drafter gets every row, in order. The text stays exact. (Computed after each
    forward, no call would cover more than the pending token and the 4 nodes a forward
    verifies here: the server drafts nothing of its own.)"""
    from cloud_server.decoding.activation_rows import RowKeeper
    from cloud_server.decoding.server_decoding import ServerDecoder
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ServerDecoder, "propose",
                        lambda self, context, nodes=None: Proposal(DraftTree.chain([])))
    prompt, max_new = PROMPTS[0], 64
    _deciding(monkeypatch, lambda n: Next.REST if 4 <= n < 16 else Next.DRAFT)
    log: list[tuple] = []
    _logging_the_server(monkeypatch, log)
    computed: list[tuple[int, int]] = []
    real_compute = RowKeeper._compute
    monkeypatch.setattr(RowKeeper, "_compute", lambda self, cache: (
        self._pending and computed.append((self._pending[0][0], self._pending[-1][1])),
        real_compute(self, cache))[-1])
    added: list[tuple[int, int]] = []
    real_add = MoaDrafter.add_activations
    monkeypatch.setattr(MoaDrafter, "add_activations", lambda self, start, values: (
        added.append((start, len(values))), real_add(self, start, values))[-1])
    result, = run(moa_server.address, ClientOptions("moa", 4, max_new, pace=Pace.AUTO),
                  prompts=[prompt])
    assert result.output_ids == plain_greedy(tiny_target, prompt, max_new)

    decisions = [e[1] for e in log if e[0] == "decide"]
    verdicts = [e for e in log if e[0] == "verdict"]
    assert [v[1] for v in verdicts] == decisions[:len(verdicts)]  # each Verdict says it
    assert Next.REST in decisions and decisions[-1] is Next.DRAFT
    told, rest_lengths = None, set()
    for event in log:
        if event[0] == "decide":
            told = event[1]
        elif told is Next.REST:  # resting: nothing with rows, no draft from a rest
            assert event[0] != "rows" and not (event[0] == "verdict" and event[3]), event
        if event[0] == "verdict" and event[1] is Next.REST:
            rest_lengths.add(event[2])
        if event[0] == "draft" and event[2]:
            assert event[1] not in rest_lengths, event
    assert max(end - start for start, end in computed) > 8  # what the rest held back, at once
    assert added[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(added, added[1:]))
    assert sum(n for _, n in added) >= max(rest_lengths)  # past the rest, nothing missing


def test_a_client_on_a_link_too_slow_for_drafts_rests_from_the_first_verdict(
        tiny_target, tiny_drafter_dir, tmp_path, monkeypatch):
    """The edge measures its round trip (100 ms here) at connect and sends it with its Open
    (Open.rtt_ms): against the tiny target's few-ms forwards no draft could pay the wait,
    not even a probe's. Every Verdict tells it to rest, so no row crosses the link, not even
    the prompt's, and it drafts nothing; the next generation on the same client rests as
    well. Every text stays exact."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    max_new = 24
    prompts = [PROMPTS[0], PROMPTS[1]]
    log: list[tuple] = []
    _logging_the_server(monkeypatch, log)
    proposed: list[int] = []
    real_propose = MoaDrafter.propose
    monkeypatch.setattr(MoaDrafter, "propose", lambda self, context, *args, **kw: (
        proposed.append(len(context)), real_propose(self, context, *args, **kw))[-1])
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=50))
    with ServerThread(tiny_target, ServerConfig(replace(LIMITS, max_new_tokens=max_new),
                                                drafter_dir=tiny_drafter_dir)) as server, \
            ProxyThread(server.address, slow) as proxy:
        results = run(proxy.address, ClientOptions("moa", 4, max_new, pace=Pace.AUTO),
                      prompts=prompts)
    assert [r.output_ids for r in results] == [plain_greedy(tiny_target, p, max_new)
                                               for p in prompts]
    assert all(r.pace is Pace.AUTO and r.rtt_s >= 0.1 for r in results)
    verdicts = [e for e in log if e[0] == "verdict"]
    assert len(verdicts) >= 2 * 2 and all(v[1] is Next.REST for v in verdicts)
    assert not any(v[3] for v in verdicts) and not any(e[0] == "rows" for e in log)
    assert not any(e[0] == "draft" and e[2] for e in log) and not proposed


def test_a_resume_gets_the_trailing_rows_its_broken_stream_lost(tiny_target, tiny_drafter_dir,
                                                                monkeypatch):
    """The stream breaks after the prefill's Verdict, before the prompt's rows that trail it:
    the resume says it holds none (Resume.rows_held) and gets them all again."""
    from cloud_server.rpc import session_streams

    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    prompt = tuple(range(40, 100))
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, pace=Pace.SERVER,
                          activations=ActivationFormat.FP16, lead=1)

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
                          activations=ActivationFormat.FP16, lead=lead)

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


def test_a_lockstep_verdict_keeps_its_rows_inside(tiny_target, tiny_drafter_dir, monkeypatch):
    """In lock-step the edge drafts from a Verdict's rows next: they travel inside it, however
    many (the prompt's), and no rows trail it."""
    from cloud_server.rpc import session_streams

    monkeypatch.setattr(session_streams, "INLINE_ACTIVATION_BYTES", 1024)
    prompt = tuple(range(40, 100))
    request = OpenRequest(prompt_ids=prompt, max_new_tokens=4, pace=Pace.LOCKSTEP,
                          activations=ActivationFormat.FP16)

    async def go(address: str) -> list:
        async with ServerLink(address) as link:
            stream = link.decode()
            await stream.send(request)
            opened, first = await stream.recv(), await stream.recv()
            await stream.send(DraftRequest(1, len(prompt) + 1, DraftTree.chain([7])))
            second = await stream.recv()
            stream.cancel()
            return [opened, first, second]
    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        opened, first, second = asyncio.run(go(server.address))
    assert opened.pace is Pace.LOCKSTEP and first.next is Next.DRAFT
    assert len(first.activations.values) == len(prompt)
    assert isinstance(second, Verdict) and second.activations.start == len(prompt)
