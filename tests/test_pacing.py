"""Server pacing (cloud_server/pacing.py, stream_buffers.py): the inbox of client drafts, the
auto pace's waiting rule, and flow control and bad drafts over the wire on the tiny server."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Callable

import grpc
import numpy as np

import pytest

from cloud_server import stream_buffers
from cloud_server.decode_loop import DecodeLoop, Forward, Forwarded, Send
from cloud_server.pacing import (
    LEARNING_FORWARDS, RELEARN_AFTER, AutoPace, PacingPolicy, wait_policy,
)
from cloud_server.stream_buffers import Inbox, Outbox
from shared import wire
from shared.errors import OutOfOrder
from shared.messages import ActivationRows, DraftRequest, FinishReason, Pace, Verdict
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from shared.tree import DraftTree
from tests.test_server_errors import BASE, CLOSE, draft_msg, open_msg, run_stream

TREE = DraftTree((7,), (-1,))


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


def test_inbox_keeps_the_freshest_draft_and_the_longest_acknowledgement():
    inbox = Inbox(acked=4)
    inbox.put(DraftRequest(1, 5, TREE), committed=6)
    inbox.put(DraftRequest(3, 6, DraftTree((), ())), committed=6)  # an acknowledgement only
    assert inbox.draft.round_id == 1 and inbox.acked == 6
    inbox.used(1)
    assert inbox.draft is None


@pytest.mark.parametrize("draft, words", [
    (DraftRequest(1, 5, TREE), "ids must grow"),
    (DraftRequest(9, 7, TREE), "7 tokens, but 6 are committed"),
])
def test_inbox_refuses_drafts_out_of_order(draft, words):
    inbox = Inbox(acked=4)
    inbox.put(DraftRequest(1, 5, TREE), committed=6)
    with pytest.raises(OutOfOrder, match=words):
        inbox.put(draft, committed=6)


def test_inbox_wait_wakes_on_a_draft_and_times_out_without_one():
    async def go():
        inbox = Inbox(acked=4)
        asyncio.get_running_loop().call_later(0.01, inbox.put, DraftRequest(1, 6, TREE), 6)
        woke = await inbox.wait(lambda: inbox.acked >= 6, 5.0)
        timed_out = await inbox.wait(lambda: inbox.acked >= 7, 0.01)
        return woke, timed_out
    assert asyncio.run(go()) == (True, False)


def test_auto_waits_for_a_reply_due_within_the_allowance_only():
    auto = AutoPace(step_s=0.06, reply_s=0.01, gain_client=2.4, gain_server=1.2,
                    drafted=True)
    assert auto.allowance_s() == pytest.approx(0.03)  # half a step at most
    auto.sent(10, now=0.0)
    assert 0.01 <= auto.wait_s(10, now=0.0) <= 0.03  # due in 10 ms: worth waiting for
    auto.reply_s = 0.1  # due in 100 ms: the server goes on with its own candidates
    assert auto.wait_s(10, now=0.0) == 0.0


def test_auto_weighs_the_larger_forward_a_client_draft_brings():
    """A fresh draft commits 2.2 tokens against the server's own 1.4, but its merged tree makes
    the forward 80 ms against 60: waiting pays for at most 2.2 * 60 / (0.9 * 1.4) - 80 = 25 ms
    (FORWARD_THRIFT), so a reply due in 30 ms is not waited for (one step time for both would
    have allowed 30 ms)."""
    auto = AutoPace(reply_s=0.03, gain_client=2.2, gain_server=1.4)
    for _ in range(50):
        auto.forwarded(tokens=2, fresh=True, step_s=0.08)
        auto.forwarded(tokens=1, fresh=False, step_s=0.06)
    auto.gain_client, auto.gain_server = 2.2, 1.4
    assert auto.allowance_s() == pytest.approx(2.2 * 0.06 / (0.9 * 1.4) - 0.08, rel=1e-3)
    auto.sent(10, now=0.0)
    assert auto.wait_s(10, now=0.0) == 0.0


def test_alone_auto_gives_a_little_token_rate_to_save_a_forward():
    """A fresh draft: 2.0 tokens in 28 ms; the server's own: 1.5 in 25 ms. Waiting 8 ms for the
    draft commits 2.0 / 36 ms = 56 tokens/s against 60 without: within FORWARD_THRIFT, so the
    server waits, and makes fewer forwards (on even rates alone it would not wait past 5 ms)."""
    auto = AutoPace(step_s=0.025, client_step_s=0.028, reply_s=0.008, gain_client=2.0,
                    gain_server=1.5, fresh_forwards=LEARNING_FORWARDS)
    assert auto.allowance_s() == pytest.approx(2.0 * 0.025 / (0.9 * 1.5) - 0.028)
    auto.sent(10, now=0.0)
    assert auto.wait_s(10, now=0.0) == pytest.approx(0.008)
    auto.gain_client = 1.6  # 44 tokens/s: past the thrift, not worth the wait
    assert auto.wait_s(10, now=0.0) == 0.0


def test_auto_sets_a_draft_against_what_the_same_forwards_would_have_committed_alone():
    """Fresh drafts come where the text repeats, and there the server's own candidates do well
    too: forwards with one commit 2 tokens against about 1 without, but the server alone would
    have committed both. A wait for such drafts saves no forward, so auto waits for none, even
    under load; drafts that add a token still get their wait."""
    auto = AutoPace(step_s=0.025, client_step_s=0.026, reply_s=0.005)
    for _ in range(40):
        auto.forwarded(tokens=2, fresh=True, step_s=0.026, alone=2)
        auto.forwarded(tokens=1, fresh=False, step_s=0.025)
    assert auto.gain_client > 1.5 * auto.gain_server
    auto.sent(10, now=0.0)
    assert auto.allowance_s() == 0.0 and auto.wait_s(10, now=0.0, busy=True) == 0.0
    for _ in range(40):
        auto.forwarded(tokens=3, fresh=True, step_s=0.026, alone=2)
    assert auto.wait_s(10, now=0.0) == pytest.approx(0.005)


def test_the_first_measured_draft_replaces_the_prior():
    """Drafts that add nothing, measured in the learning forwards: auto then waits for none,
    instead of carrying the prior's 2.0 tokens a draft into its running mean."""
    auto = AutoPace(step_s=0.07, client_step_s=0.07, reply_s=0.02)
    for _ in range(LEARNING_FORWARDS):
        auto.forwarded(tokens=1, fresh=True, step_s=0.07, alone=1)
    assert auto.gain_client == 1.0 and auto.allowance_s() == 0.0


def test_the_learning_forwards_count_alike():
    """Three fresh forwards committing 1, 3 and 2 tokens, the server's tree alone 1 in each:
    drafts add a token a forward on average, whichever forward came first."""
    auto = AutoPace()
    for tokens in (1, 3, 2):
        auto.forwarded(tokens=tokens, fresh=True, step_s=0.05, alone=1)
    assert auto.gain_client == pytest.approx(2.0) and auto.gain_alone == 1.0


def test_auto_waits_to_learn_what_drafts_are_worth_before_it_trusts_its_prior():
    """A prior that says drafts do not pay must not keep auto from ever measuring them: the
    edge's unused drafts would be overtaken and it would rest, unmeasured."""
    auto = AutoPace(step_s=0.03, reply_s=0.01, gain_client=1.0, gain_server=2.0,
                    drafted=True)
    auto.sent(10, now=0.0)
    assert auto.wait_s(10, now=0.0) == pytest.approx(0.01)  # due within half a step
    for _ in range(LEARNING_FORWARDS):
        auto.forwarded(tokens=1, fresh=True, step_s=0.03)
    assert auto.wait_s(10, now=0.0) == 0.0  # measured: not worth it


@pytest.mark.parametrize("replies, waits", [((0.02, 0.02), True), ((0.022, 0.038), False)])
def test_auto_waits_only_for_answers_that_come_in_time_reliably(replies, waits):
    """Answers at 20 ms every time are worth a wait within a 30 ms allowance; answers at
    30 ms on average, half of them late, are not."""
    auto = AutoPace(step_s=0.06, gain_client=2.4, gain_server=1.2, drafted=True)
    for n in range(40):
        auto.sent(n, now=float(n))
        auto.answered(n, at=n + replies[n % 2])
    auto.sent(40, now=40.0)
    assert auto.allowance_s() == pytest.approx(0.03)
    assert (auto.wait_s(40, now=40.0) > 0) is waits


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


def test_an_answer_that_comes_too_late_to_be_waited_for_is_not_awaited():
    """The client is told its answer is awaited only when it comes within the allowance
    reliably (as wait_s waits), and before the reply time is measured, so it gets measured."""
    auto = AutoPace(step_s=0.06, gain_client=2.4, gain_server=1.2, drafted=True)
    assert auto.awaits()  # reply time unknown: the answer teaches it
    auto.sent(10, now=10.0)
    auto.answered(10, at=10.1)  # 100 ms, against an allowance of half a 60 ms step
    assert auto.allowance_s() > 0 and not auto.awaits()
    assert auto.awaits(busy=True)  # loaded: the allowance is four steps
    auto.sent(20, now=20.0)
    assert auto.wait_s(20, now=20.0) == 0.0  # as told: the server does not wait for it


def test_auto_waits_for_nothing_before_it_knows_the_reply_time():
    auto = AutoPace(step_s=0.06, gain_client=2.4, gain_server=1.2, drafted=True)
    auto.sent(10, now=0.0)
    assert auto.allowance_s() > 0 and auto.wait_s(10, now=0.0) == 0.0


def test_under_load_auto_waits_longer_for_drafts_that_pay():
    auto = AutoPace(step_s=0.06, reply_s=0.1, gain_client=2.4, gain_server=1.2)
    auto.sent(10, now=0.0)
    assert auto.wait_s(10, now=0.0, busy=False) == 0.0  # alone: not worth 100 ms
    assert 0.1 <= auto.wait_s(10, now=0.0, busy=True) <= 4 * 0.06  # loaded: worth it
    auto.reply_s = 0.3  # past four steps: not even under load
    assert auto.wait_s(10, now=0.0, busy=True) == 0.0
    auto.reply_s, auto.gain_client = 0.1, 1.0  # drafts that do not pay: no wait at all
    assert auto.wait_s(10, now=0.0, busy=True) == 0.0


def learnt_not_to_wait(reply_s: float) -> AutoPace:
    """Auto after learning forwards in which the server's own candidates committed as much as
    the client's drafts brought (2 tokens), with answers due in `reply_s`."""
    auto = AutoPace(step_s=0.075, reply_s=reply_s, drafted=True)
    for _ in range(LEARNING_FORWARDS):
        auto.forwarded(tokens=2, fresh=True, step_s=0.075, alone=2)
    assert auto.allowance_s() == 0.0
    return auto


def test_auto_learns_again_where_its_own_candidates_fell_off():
    """Drafts measured as adding nothing on a stretch the server's own candidates followed:
    once those commit one token a forward, auto measures the drafts again (it waits to
    learn), and does so ever more seldom while they still add nothing."""
    auto = learnt_not_to_wait(reply_s=0.006)
    for _ in range(RELEARN_AFTER - 1):
        auto.forwarded(tokens=1, fresh=False, step_s=0.075)
    assert auto.allowance_s() == 0.0  # not yet: a few forwards do not make a text
    auto.forwarded(tokens=1, fresh=False, step_s=0.075)
    assert auto.allowance_s() == pytest.approx(0.0375)  # learning: half a step
    auto.sent(10, now=0.0)
    assert auto.wait_s(10, now=0.0) == pytest.approx(0.006)
    for _ in range(LEARNING_FORWARDS):  # the server's own candidates followed again
        auto.forwarded(tokens=2, fresh=True, step_s=0.075, alone=2)
    for _ in range(2 * RELEARN_AFTER - 1):  # twice as long before the next learning
        auto.forwarded(tokens=1, fresh=False, step_s=0.075)
        assert auto.allowance_s() == 0.0
    auto.forwarded(tokens=1, fresh=False, step_s=0.075)
    for _ in range(LEARNING_FORWARDS):  # now the drafts add a token a forward: waited for
        auto.forwarded(tokens=2, fresh=True, step_s=0.075, alone=1)
    assert auto.wait_s(10, now=0.0) == pytest.approx(0.006)


@pytest.mark.parametrize("reply_s, tokens", [(0.06, 1), (0.006, 2)])
def test_auto_learns_again_only_where_a_wait_could_pay(reply_s, tokens):
    """No second learning where answers come too late for any wait (a slow link), or where
    the server's own candidates commit as much as before."""
    auto = learnt_not_to_wait(reply_s)
    for _ in range(4 * RELEARN_AFTER):
        auto.forwarded(tokens=tokens, fresh=False, step_s=0.075)
        assert auto.allowance_s() == 0.0


def test_auto_learns_what_fresh_drafts_are_worth():
    auto = AutoPace()
    for _ in range(30):
        auto.forwarded(tokens=1, fresh=True, step_s=0.03)  # drafts that never pay
    assert auto.allowance_s() == 0.0
    auto.sent(12, now=1.0)
    auto.answered(12, at=1.05)
    assert auto.reply_s == pytest.approx(0.05)


def test_policy_caps_the_lead_and_fills_defaults():
    policy = PacingPolicy(pace=Pace.LOCKSTEP, lead=32, max_lead=64)
    assert policy.resolve(None, 0) == (Pace.LOCKSTEP, 32)
    assert policy.resolve(Pace.SERVER, 1000) == (Pace.SERVER, 64)


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
        await asyncio.sleep(0.05)
        ran_while_blocked = committed[0]
        link_free.set()
        await asyncio.sleep(0.05)
        owned[0] = False  # a resume on another stream took the session
        inbox.put(DraftRequest(1, 14, DraftTree((), ())), committed=14)
        await asyncio.wait_for(loop, 1)
        await outbox.flush()
        return ran_while_blocked, committed[0], written
    ran_while_blocked, final, written = asyncio.run(go())
    assert ran_while_blocked == 14 and final == 14
    assert written == [11, 12, 13, 14]


def test_a_verdict_is_handed_to_the_stream_before_the_next_forward(monkeypatch):
    """Outbox.send returns once the stream has taken the Verdict (its write completed), so the
    write's completion does not interrupt the next forward; a write the link does not take
    holds the session back HAND_OFF_S once, and a writer still busy with it not at all. The
    waits are read from the timeouts the outbox enters, not from a clock a busy machine skews."""
    monkeypatch.setattr(stream_buffers, "HAND_OFF_S", 0.3)  # far above the loop's jitter on a busy CI
    timeouts: list[asyncio.Timeout] = []
    real_timeout = asyncio.timeout

    def recorded(delay: float | None) -> asyncio.Timeout:
        timeouts.append(real_timeout(delay))
        return timeouts[-1]
    monkeypatch.setattr(stream_buffers.asyncio, "timeout", recorded)

    async def go():
        written: list[int] = []
        link_free = asyncio.Event()

        async def write(verdict: Verdict) -> None:
            for _ in range(3):  # gRPC completes a write on a later turn of the loop
                await asyncio.sleep(0)
            written.append(verdict.committed_length)
            if verdict.committed_length == 12:
                await link_free.wait()
        outbox = Outbox(write)
        await outbox.send(Verdict(1, (), (1,), 11))
        taken_before_return = list(written)
        await outbox.send(Verdict(2, (), (1,), 12))  # taken, but its write does not complete
        waits_after_held = len(timeouts)
        await outbox.send(Verdict(3, (), (1,), 13))  # the writer is busy: no wait
        waits_after_busy = len(timeouts)
        link_free.set()
        await outbox.flush()
        return taken_before_return, waits_after_held, waits_after_busy, written
    taken_before_return, waits_after_held, waits_after_busy, written = asyncio.run(go())
    assert taken_before_return == [11]
    assert waits_after_held == 2 and not timeouts[0].expired() and timeouts[1].expired()
    assert waits_after_busy == 2  # the busy writer was not waited for
    assert written == [11, 12, 13]


def _rows(start: int, n: int) -> ActivationRows:
    return ActivationRows(start, np.full((n, 4), start, dtype=np.float16))  # 8 bytes a row


def test_verdicts_go_before_rows_the_client_has_not_acknowledged():
    """Rows go out in parts while at most `rows_in_flight` bytes of them are unacknowledged; a
    Verdict goes before the rows still waiting, its own rows join them, and rows arrive in
    order. A Verdict that ends the generation takes no rows, and flush drops those waiting."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16, 10 * 8), 20 * 8)

        async def settled() -> list:
            await asyncio.sleep(0.01)
            got = list(written)
            written.clear()
            return [(type(m).__name__, m.start if isinstance(m, ActivationRows)
                     else m.committed_length) for m in got]
        await outbox.put(Verdict(0, (), (5,), 50, activations=_rows(0, 49)))
        steps = [await settled()]
        await outbox.put(Verdict(1, (), (6,), 51, activations=_rows(49, 1)))
        steps.append(await settled())
        outbox.held(20)
        steps.append(await settled())
        outbox.held(40)
        steps.append(await settled())
        await outbox.put(Verdict(2, (), (7,), 52, FinishReason.LENGTH, activations=_rows(50, 1)))
        await outbox.flush()
        steps.append(await settled())
        return steps
    steps = asyncio.run(go())
    assert steps[0] == [("Verdict", 50), ("ActivationRows", 0), ("ActivationRows", 10)]
    assert steps[1] == [("Verdict", 51)]  # before rows 20..49, which wait for the client
    assert steps[2] == [("ActivationRows", 20), ("ActivationRows", 30)]
    assert steps[3] == [("ActivationRows", 40), ("ActivationRows", 49)]  # 49: Verdict 51's
    assert steps[4] == [("Verdict", 52)]


def test_rows_past_the_budget_or_paused_wait_even_those_inside_verdicts():
    """A Verdict's few rows go inside it while the budget has room; past it the Verdicts go
    alone and their rows wait, in order, until the client acknowledges more. Paused, no rows
    go at all until the client wants them again."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16 * 8, 10 * 8), 20 * 8)
        for start, n in ((0, 16), (16, 2), (18, 4), (22, 1)):
            await outbox.put(Verdict(start, (), (5,), start + n + 1,
                                     activations=_rows(start, n)))
            await asyncio.sleep(0.01)
        paused = [(m.committed_length, m.activations and m.activations.start)
                  for m in written]
        written.clear()
        outbox.held(18, paused=True)
        await outbox.put(Verdict(4, (), (5,), 25, activations=_rows(23, 1)))
        await asyncio.sleep(0.01)
        still_paused = [(m.committed_length, m.activations) for m in written]
        written.clear()
        outbox.held(18)
        await asyncio.sleep(0.01)
        await outbox.flush()
        return paused, still_paused, [m.start for m in written]
    paused, still_paused, resumed = asyncio.run(go())
    assert paused == [(17, 0), (19, 16), (23, None), (24, None)]
    assert still_paused == [(25, None)]
    assert resumed == [18, 22, 23]


def test_without_acknowledgements_rows_follow_their_verdict_at_once():
    """A client that does not acknowledge rows gets them all as soon as the link takes them."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16, 10 * 8))
        await outbox.put(Verdict(0, (), (5,), 50, activations=_rows(0, 49)))
        await asyncio.sleep(0.01)
        await outbox.put(Verdict(1, (), (6,), 51, activations=_rows(49, 1)))
        await outbox.flush()
        return [m.start if isinstance(m, ActivationRows) else -m.committed_length
                for m in written]
    assert asyncio.run(go()) == [-50, 0, 10, 20, 30, 40, -51]


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
