"""The server's one decode loop (cloud_server/decoding/decode_loop.py) under each pace rule: what
every Verdict tells the client to do next (Verdict.next), decided before its forward; flow control
under the lead; a link that does not take a Verdict; auto's waits for the drafts it asked for and
its rests; and the loop's rules over the wire on the tiny server."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest

from cloud_server.decoding.decode_loop import DecodeLoop, Forward, Forwarded, Send, Told
from cloud_server.decoding.pacing import AutoPace, Lockstep, PaceRule, ServerPace
from cloud_server.rpc.stream_buffers import Inbox, Outbox
from shared.errors import OutOfOrder
from shared.messages import DraftRequest, Next, Pace, Verdict
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from shared.tree import DraftTree
from testkit.raw_stream import BASE, CLOSE, PROMPT, draft_msg, open_msg, run_stream
from testkit.waiting import until

TREE = DraftTree.chain([7])
ACK = DraftTree((), ())
DRAFT_NODES = 12  # what the tests' forward builder sizes a draft a Verdict asks for


async def run_paced(committed: Callable[[], int], finished: Callable[[], bool], inbox: Inbox,
                    forward: Forward, send: Send, rule: PaceRule, lead: int | None,
                    told: Told = lambda next_: None, first: Forward | None = None) -> None:
    """The decode loop under `rule` over a session seen through two counters; `first` makes
    the Verdict sent before the loop (a prefill's), as a forward would."""
    class Counted:
        @property
        def committed(self) -> range:
            return range(committed())

        @property
        def finished(self) -> bool:
            return finished()
    async def prefill() -> Verdict:
        return (await first(None, 0.0)).verdict
    await DecodeLoop(Counted(), inbox, rule, forward, send, lead, told=told,
                     draft_nodes=lambda: DRAFT_NODES).run(None if first is None else prefill)


@dataclass
class Decided(AutoPace):
    """Auto pace whose n-th decision (from 1) the test fixes: `says(n)`. What it waits for,
    measures and allows is auto's own."""

    says: Callable[[int], Next] = lambda n: Next.DRAFT
    decisions: int = 0

    def decide(self, busy: bool) -> Next:
        super().decide(busy)
        self.decisions += 1
        return self.says(self.decisions)


def one_token_forwards(committed: list[int], log: list | None = None,
                       forward_s: float = 0.0) -> Forward:
    """A forward committing one token (after `forward_s`, a simulated step), logged."""
    async def forward(draft, queued_at) -> Forwarded:
        if forward_s:
            await asyncio.sleep(forward_s)
        if log is not None:
            log.append(("forward",))
        committed[0] += 1
        return Forwarded(Verdict(committed[0], (), (1,), committed[0]), 1)
    return forward


@pytest.mark.parametrize("rule", [Lockstep(), ServerPace(),
                                  Decided(0.02, 0.001, says=lambda n: (
                                      Next.REST if 3 <= n < 8 else Next.DRAFT))],
                         ids=["lockstep", "server", "auto"])
def test_every_verdict_says_what_the_client_does_next_as_decided_before_its_forward(rule):
    """Lock-step and server pace ask for a draft every time; auto as it decides. The loop
    hears each decision (`told`: the session pauses the activation rows with it) before the
    forward whose Verdict carries it, and the Verdict sizes the draft it asks for
    (draft_nodes, none when it says rest). The inbox then refuses a draft with tokens from a
    Verdict that said rest; an acknowledgement from it is fine. The client answers each
    Verdict at once (lock-step waits for the answer, from the prefill's Verdict on)."""
    refused: list[str] = []

    async def go() -> list:
        committed, log = [10], []
        inbox = Inbox(acked=10, answers_each=isinstance(rule, Lockstep))
        ids = iter(range(1, 1000))
        forward = one_token_forwards(committed, log)

        async def send(verdict: Verdict) -> None:
            log.append(("sent", verdict.next, verdict.draft_nodes))
            n = verdict.committed_length
            if verdict.next is Next.REST:
                with pytest.raises(OutOfOrder) as err:
                    inbox.put(DraftRequest(next(ids), n, TREE), n)
                refused.append(str(err.value))
                inbox.put(DraftRequest(next(ids), n, ACK), n)
            else:
                inbox.put(DraftRequest(next(ids), n, TREE), n)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 30, inbox, forward, send,
                        rule, lead=64, told=lambda next_: log.append(("told", next_)),
                        first=forward)
        return log
    log = asyncio.run(go())
    told = [e[1] for e in log[::3]]
    expected = [Next.REST if 3 <= n < 8 else Next.DRAFT for n in range(1, 21)]
    assert told == (expected if isinstance(rule, AutoPace) else [Next.DRAFT] * 20)
    assert log == [e for next_ in told for e in (
        ("told", next_), ("forward",),
        ("sent", next_, DRAFT_NODES if next_ is Next.DRAFT else 0))]
    assert len(refused) == told.count(Next.REST)
    assert all("where the server said rest" in r for r in refused)


def test_a_session_with_no_client_tells_it_nothing():
    """Generate, or a session going on after its stream broke: its Verdicts say nothing."""
    async def go() -> list[Verdict]:
        committed, sent = [10], []

        async def send(verdict: Verdict) -> None:
            sent.append(verdict)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 14,
                        Inbox(acked=10, fed=False), one_token_forwards(committed), send,
                        PaceRule(), lead=None)
        return sent
    assert [(v.next, v.draft_nodes) for v in asyncio.run(go())] == [(None, 0)] * 4


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
                                             forward, outbox.send, ServerPace(), lead=4))
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
        acknowledged = len(PROMPT)  # the Open's: the prefill's token counts against the lead
        committed = _last_length(got, acknowledged + lead)
        assert committed <= acknowledged + lead + 8
        sent.put(draft_msg(1, committed, (), ()))  # acknowledges all of it
        assert got.get(timeout=10).verdict.committed_length > committed
        call.cancel()
        reader.join(5)


def _drain(call, got: queue.Queue) -> None:
    with contextlib.suppress(grpc.RpcError):  # cancelled at the end of the test
        for reply in call:
            got.put(reply)


def _last_length(got: queue.Queue, at_least: int) -> int:
    """The committed length of the last Verdict once one has reached `at_least` (within 10 s
    each) and the stream then goes quiet for 0.5 s."""
    length = 0
    while length < at_least:
        length = got.get(timeout=10).verdict.committed_length
    while True:
        try:
            length = got.get(timeout=0.5).verdict.committed_length
        except queue.Empty:
            return length


def _converse(address: str, opening: pb.ClientMessage,
              answer: Callable[[int, pb.Verdict], pb.ClientMessage | None]
              ) -> list[pb.ServerMessage]:
    """A Decode stream that answers each Verdict as `answer(draft id, verdict)` says (None:
    not at all), then closes after Done: every reply, in order."""
    feed: queue.Queue = queue.Queue()
    feed.put(opening)
    replies = []
    with grpc.insecure_channel(address) as channel:
        for reply in pb_grpc.SplitDecodingStub(channel).Decode(iter(feed.get, None), timeout=20):
            replies.append(reply)
            kind = reply.WhichOneof("kind")
            if kind == "verdict" and reply.verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                msg = answer(len(replies), reply.verdict)
                if msg is not None:
                    feed.put(msg)
            elif kind == "done":
                feed.put(CLOSE)
                feed.put(None)
    return replies


def _answer_with_a_draft(round_id: int, verdict: pb.Verdict) -> pb.ClientMessage:
    return draft_msg(round_id, verdict.committed_length)


def _acknowledge_drafts_asked_for(round_id: int, verdict: pb.Verdict) -> pb.ClientMessage | None:
    if verdict.next != pb.NEXT_DRAFT:
        return None
    return draft_msg(round_id, verdict.committed_length, (), ())


@pytest.mark.parametrize("pace, answer", [
    (pb.PACE_LOCKSTEP, _answer_with_a_draft), (pb.PACE_SERVER, lambda *_: None),
    (pb.PACE_AUTO, _acknowledge_drafts_asked_for)], ids=["lockstep", "server", "auto"])
def test_every_verdict_of_a_decode_stream_tells_the_client_what_to_do_next(tiny_server, pace,
                                                                          answer):
    """At the wire: every Verdict of a Decode session carries next; lock-step and server pace
    always say draft, and only a paced server sizes the draft (draft_nodes). Auto stays auto
    for a client whose drafter reads the text alone (no activation rows asked for)."""
    replies = _converse(tiny_server.address, open_msg(pace=pace, max_new_tokens=12), answer)
    assert replies[0].opened.pace == pace
    assert replies[-1].WhichOneof("kind") == "done"
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert len(verdicts) >= 2
    if pace == pb.PACE_AUTO:
        assert all(v.next in (pb.NEXT_DRAFT, pb.NEXT_REST) for v in verdicts)
    else:
        assert all(v.next == pb.NEXT_DRAFT for v in verdicts)
    nodes = [v.draft_nodes for v in verdicts if v.next == pb.NEXT_DRAFT]
    assert all(n == 0 for n in nodes) if pace == pb.PACE_LOCKSTEP else all(n > 0 for n in nodes)
    assert all(v.draft_nodes == 0 for v in verdicts if v.next == pb.NEXT_REST)


def test_generate_verdicts_tell_nobody_anything(tiny_server):
    with grpc.insecure_channel(tiny_server.address) as channel:
        replies = list(pb_grpc.SplitDecodingStub(channel).Generate(pb.GenerateRequest(
            open=open_msg(max_new_tokens=6).open), timeout=20))
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert verdicts and all(v.next == pb.NEXT_UNSPECIFIED for v in verdicts)


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


@pytest.mark.parametrize("says, waits", [(Next.DRAFT, 15), (Next.REST, 0)])
def test_auto_waits_for_the_answer_it_asked_for_and_for_no_other(says, waits):
    """A client that answers each Verdict at once up to 14 tokens, then no more. Where auto
    asked for a draft, each forward after that waits for the answer (within auto's allowance);
    where it told the client to rest, none waits: it asked for nothing."""
    async def go() -> list[float]:
        committed, inbox = [10], Inbox(acked=10)
        waits = _recording_waits(inbox)

        async def send(verdict: Verdict) -> None:
            n = verdict.committed_length
            if n <= 14:
                inbox.put(DraftRequest(n, n, ACK), n)
        await run_paced(lambda: committed[0], lambda: committed[0] >= 30, inbox,
                        one_token_forwards(committed, forward_s=0.002), send,
                        Decided(0.02, 0.001, says=lambda n: says), lead=64)
        return waits
    assert len(asyncio.run(go())) == waits  # one for each forward at 15, ..., 29


def test_auto_rests_while_its_own_candidates_keep_up_and_asks_again_once_they_fall_off():
    """The first stretch, the server's own tree commits what the client's drafts do (2 tokens
    a forward): a wait for a draft stops paying, and auto tells the client to rest (it sends
    nothing then). Afterwards its own forwards commit 1 while a fresh draft would still bring
    2: at rest auto measures its own forwards fall off, and asks for drafts again, to the
    end."""
    async def go() -> list[Next | None]:
        committed, inbox, said = [10], Inbox(acked=10), []

        async def forward(draft, queued_at) -> Forwarded:
            await asyncio.sleep(0.02)  # a step of the server's
            fresh = draft is not None and draft.base_length == committed[0]
            alone = 2 if len(said) < 16 else 1
            tokens = 2 if fresh else alone
            committed[0] += tokens
            return Forwarded(Verdict(committed[0], (), (1,) * tokens, committed[0],
                                     draft_id=draft.round_id if fresh else 0), alone)

        async def send(verdict: Verdict) -> None:
            said.append(verdict.next)
            n = verdict.committed_length
            if verdict.next is Next.DRAFT:  # the client's draft comes 3 ms later
                asyncio.get_running_loop().call_later(0.003, inbox.put,
                                                      DraftRequest(n, n, TREE), n)
        await run_paced(lambda: committed[0], lambda: len(said) >= 40, inbox, forward, send,
                        AutoPace(step_s=0.02, reply_s=0.003), lead=256)
        return said
    said = asyncio.run(go())
    assert said[0] is Next.DRAFT
    assert Next.REST in said[4:17]  # its own candidates kept up: the drafts stopped paying
    assert all(n is Next.DRAFT for n in said[-10:])  # they fell off: drafts asked for again
