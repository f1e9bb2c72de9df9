"""The server's one decode loop (cloud_server/decoding/decode_loop.py) under each wait policy: what the
client is told of its answers, flow control under the lead, a link that does not take a Verdict,
auto's waits as drafts come and go, and the loop's rules over the wire on the tiny server."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Callable

import grpc
import pytest

from cloud_server.decoding.decode_loop import DecodeLoop, Forward, Forwarded, Send
from cloud_server.decoding.pacing import LEARNING_FORWARDS, AutoPace, PacingPolicy, wait_policy
from cloud_server.rpc.stream_buffers import Inbox, Outbox
from shared.messages import DraftRequest, Pace, Verdict
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from shared.tree import DraftTree
from testkit.raw_stream import BASE, CLOSE, draft_msg, open_msg, run_stream
from testkit.waiting import until

TREE = DraftTree.chain([7])


async def run_paced(committed: Callable[[], int], finished: Callable[[], bool], inbox: Inbox,
                    forward: Forward, send: Send, pace: Pace, lead: int) -> None:
    """The decode loop at `pace` over a session seen through two counters."""
    class Counted:
        @property
        def committed(self) -> range:
            return range(committed())

        @property
        def finished(self) -> bool:
            return finished()
    await DecodeLoop(Counted(), inbox, wait_policy(pace), forward, send, lead).run()


def test_auto_is_server_pace_for_a_client_that_drafts_from_the_text_alone(tiny_server):
    """A text-only drafter's fresh draft brings nothing its re-rooted last one does not: a
    session that asks for no activation rows gets server pace for auto, and Opened says so
    (server pace never waits: test_the_client_is_told_whether_its_answer_is_awaited)."""
    policy = PacingPolicy(pace=Pace.AUTO)
    assert policy.resolve(Pace.AUTO, 0, reads_rows=True)[0] is Pace.AUTO
    assert policy.resolve(Pace.AUTO, 0, reads_rows=False)[0] is Pace.SERVER
    assert policy.resolve(None, 0, reads_rows=False)[0] is Pace.SERVER
    assert policy.resolve(Pace.LOCKSTEP, 0, reads_rows=False)[0] is Pace.LOCKSTEP
    responses, err = run_stream(tiny_server.address,
                                [open_msg(pace=pb.PACE_AUTO, max_new_tokens=4), CLOSE])
    assert err is None and responses[0].opened.pace == pb.PACE_SERVER


def test_the_client_is_told_whether_its_answer_is_awaited():
    """Verdict.answer_awaited: the client leaves mere acknowledgements unsent where not."""
    auto = AutoPace(step_s=0.06, reply_s=0.01, gain_client=2.4, gain_server=1.2,
                    drafted=True)
    assert auto.awaits()
    auto.drafted = False  # still learning, and no draft has come yet
    assert not auto.awaits()
    assert auto.awaits(busy=True)  # loaded: drafts that pay are waited for longer

    async def go(pace: Pace, alone: int, resting: bool = False) -> list[bool]:
        committed, inbox, said = [10], Inbox(acked=10), []

        async def forward(draft, queued_at) -> Forwarded:
            await asyncio.sleep(0.002)
            committed[0] += 2
            return Forwarded(Verdict(committed[0], (), (1, 2), committed[0]), alone)

        async def send(verdict: Verdict) -> None:
            said.append(verdict.answer_awaited)
            n = verdict.committed_length
            inbox.put(DraftRequest(n, n, TREE, rows_paused=resting), n)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 30, inbox, forward, send,
                        pace, lead=64)
        return said
    assert not any(asyncio.run(go(Pace.SERVER, alone=1)))
    assert asyncio.run(go(Pace.AUTO, alone=1))[-1]  # the edge's nodes add a token a forward
    learnt = asyncio.run(go(Pace.AUTO, alone=2))  # they add nothing: awaited while learning
    assert any(learnt[:LEARNING_FORWARDS + 2]) and not learnt[-1]
    assert not any(asyncio.run(go(Pace.AUTO, alone=1, resting=True)))  # never waited for


def test_a_link_that_does_not_take_a_verdict_holds_no_forward_back():
    """The first Verdict's write hangs (a slow link, the prompt's rows): forwards go on up to
    the lead, the Verdicts wait in the outbox and go out in order once the link takes them.
    A session taken over by another stream gets no forward from this one."""
    async def go():
        committed, written, link_free, owned = [10], [], asyncio.Event(), [True]
        inbox = Inbox(acked=10)

        async def forward(draft, queued_at) -> Forwarded:
            committed[0] += 1
            return Forwarded(Verdict(len(written), (), (1,), committed[0]), 1)

        async def write(verdict: Verdict) -> None:
            await link_free.wait()
            written.append(verdict.committed_length)
        outbox = Outbox(write)
        loop = asyncio.create_task(run_paced(lambda: committed[0], lambda: not owned[0], inbox,
                                             forward, outbox.send, Pace.SERVER, lead=4))
        await until(lambda: committed[0] >= 14, 10, "the forwards to reach the lead")
        ran_while_blocked = committed[0]
        link_free.set()
        await outbox.flush()
        owned[0] = False  # a resume on another stream took the session
        inbox.put(DraftRequest(1, 14, DraftTree((), ())), committed=14)
        await asyncio.wait_for(loop, 1)
        await outbox.flush()
        return ran_while_blocked, committed[0], written
    ran_while_blocked, final, written = asyncio.run(go())
    assert ran_while_blocked == 14 and final == 14
    assert written == [11, 12, 13, 14]


def test_server_runs_at_most_lead_tokens_past_the_acknowledgement(tiny_server):
    """A client that never answers gets `lead` tokens past what it acknowledged (one forward
    may overshoot by its accepted drafts), then nothing until it acknowledges more."""
    lead = 5
    sent: queue.Queue = queue.Queue()
    got: queue.Queue = queue.Queue()
    sent.put(open_msg(pace=pb.PACE_SERVER, lead=lead, max_new_tokens=40))
    with grpc.insecure_channel(tiny_server.address) as channel:
        call = pb_grpc.SplitDecodingStub(channel).Decode(iter(sent.get, None), timeout=20)
        reader = threading.Thread(target=_drain, args=(call, got), daemon=True)
        reader.start()
        opened = got.get(timeout=10).opened
        assert (opened.pace, opened.lead) == (pb.PACE_SERVER, lead)
        committed = _last_length(got)
        assert BASE + lead <= committed <= BASE + lead + 8
        sent.put(draft_msg(1, committed, (), ()))  # acknowledges all of it
        assert got.get(timeout=10).verdict.committed_length > committed
        call.cancel()
        reader.join(5)


def _drain(call, got: queue.Queue) -> None:
    with contextlib.suppress(grpc.RpcError):  # cancelled at the end of the test
        for reply in call:
            got.put(reply)


def _last_length(got: queue.Queue) -> int:
    """The committed length of the last Verdict before the stream goes quiet for 0.5 s."""
    length = 0
    while True:
        try:
            length = got.get(timeout=0.5).verdict.committed_length
        except queue.Empty:
            return length


def test_paced_drafts_are_checked_like_lockstep_ones(tiny_server):
    _, err = run_stream(tiny_server.address, [open_msg(pace=pb.PACE_SERVER),
                                              draft_msg(tokens=(100000,)), CLOSE])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside" in err.details()


def _recording_waits(inbox: Inbox) -> list[float]:
    """The timeouts of the inbox's waits for the client's answer (not those for the lead)."""
    waits: list[float] = []
    wait = inbox.wait

    async def recorded(ready, timeout_s: float | None) -> bool:
        if timeout_s is not None:
            waits.append(timeout_s)
        return await wait(ready, timeout_s)
    inbox.wait = recorded  # type: ignore[method-assign]
    return waits


def test_auto_waits_for_no_answer_from_a_resting_client():
    """A client that rests from drafting (Draft.rows_paused) answers only now and then
    (edge_client/paced_drafts.py): auto pace goes on at once instead of waiting for its answer
    to each Verdict, as it does for a client that answers every one."""
    async def go(resting: bool) -> list[float]:
        committed, inbox = [10], Inbox(acked=10)
        waits = _recording_waits(inbox)

        async def forward(draft, queued_at) -> Forwarded:
            await asyncio.sleep(0.002)
            committed[0] += 1
            return Forwarded(Verdict(committed[0], (), (1,), committed[0]), 1)

        async def send(verdict: Verdict) -> None:  # answered at once, then no more after 14
            n = verdict.committed_length
            if n <= 14:
                inbox.put(DraftRequest(n, n, DraftTree((), ()), rows_paused=resting), n)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 30, inbox, forward, send,
                        Pace.AUTO, lead=64)
        return waits
    assert asyncio.run(go(resting=False))
    assert not asyncio.run(go(resting=True))


@pytest.mark.parametrize("first_draft, waits", [(False, range(0, 1)),
                                                 (True, range(1, LEARNING_FORWARDS + 2))])
def test_auto_stops_waiting_for_answers_that_bring_no_draft(first_draft, waits):
    """A client that answers every Verdict in 3 ms but never with a draft (prompt lookup with
    no match in the text): auto never waits for its answers, which would teach it nothing.
    One that sent a draft first: auto waits for its answers while it learns, then no more:
    each answer it waited for added nothing to the forward after it."""
    async def go() -> list[float]:
        committed, inbox = [10], Inbox(acked=10)
        if first_draft:
            inbox.put(DraftRequest(1, 10, TREE), 10)
        waits = _recording_waits(inbox)

        async def forward(draft, queued_at) -> Forwarded:
            await asyncio.sleep(0.02)
            committed[0] += 1
            return Forwarded(Verdict(committed[0], (), (1,), committed[0]), 1)

        async def send(verdict: Verdict) -> None:
            n = verdict.committed_length
            asyncio.get_running_loop().call_later(
                0.003, inbox.put, DraftRequest(n, n, DraftTree((), ())), n)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 40, inbox, forward, send,
                        Pace.AUTO, lead=64)
        return [w for w in waits if w > 0]
    assert len(asyncio.run(go())) in waits


def test_auto_waits_again_once_its_own_candidates_fall_off():
    """The learning forwards fall where the server's own tree commits what the client's drafts
    do (2 tokens); afterwards its forwards commit 1 while a fresh draft would still bring 2.
    Auto stops waiting after learning, then learns again and waits to the end (before, it
    never waited again: the rest of the answer ran at the server's own 1 token a forward)."""
    async def go() -> list[bool]:
        committed, inbox, said = [10], Inbox(acked=10), []

        async def forward(draft, queued_at) -> Forwarded:
            await asyncio.sleep(0.02)
            fresh = draft is not None and draft.base_length == committed[0]
            alone = 2 if len(said) < 8 else 1
            tokens = 2 if fresh else alone
            committed[0] += tokens
            return Forwarded(Verdict(committed[0], (), (1,) * tokens, committed[0]), alone)

        async def send(verdict: Verdict) -> None:
            said.append(verdict.answer_awaited)
            n = verdict.committed_length
            asyncio.get_running_loop().call_later(0.003, inbox.put, DraftRequest(n, n, TREE), n)
        await run_paced(lambda: committed[0], lambda: len(said) >= 40, inbox, forward, send,
                        Pace.AUTO, lead=128)
        return said
    said = asyncio.run(go())
    learning = said.index(True)
    assert not all(said[learning:20])  # learnt on the easy stretch: waits stopped
    assert all(said[-5:])  # learnt again: every answer awaited
