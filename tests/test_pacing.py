"""The pace rules (cloud_server/decoding/pacing.py): what auto pace tells the client, how long it
waits for the draft it asked for, what it learns from each forward, what it remembers of a
client, and the server's pacing defaults. The loop that asks them: test_decode_loop.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from cloud_server.config import PacingPolicy
from cloud_server.decoding.pacing import (
    GAIN_CEILING, LOADED_WAIT_STEPS, MAX_PROBE_GAP, PROBE_GAP, AutoPace, Lockstep, PaceMemory,
    PaceRule, ServerPace,
)
from cloud_server.rpc.stream_buffers import Inbox
from shared.messages import DraftRequest, Next, Pace
from shared.tree import DraftTree


def measured(gain_with: float, gain_alone: float, step_s: float = 0.02,
             reply_s: float = 0.005) -> AutoPace:
    """An AutoPace past its prior: drafts commit `gain_with`, the server's own `gain_alone`."""
    auto = AutoPace(step_s, reply_s)
    for _ in range(60):
        auto.forwarded(tokens=round(gain_with), alone=round(gain_alone), drafted=True)
    auto.gain_with, auto.gain_alone, auto.with_s = gain_with, gain_alone, step_s
    return auto


def test_auto_asks_for_a_draft_while_its_wait_pays():
    """Drafts commit 2.4 tokens against the server's own 1.2 at 20 ms a forward: a wait of up
    to 2.4 / 1.2 * 20 - 20 = 20 ms pays."""
    auto = measured(2.4, 1.2, reply_s=0.015)
    assert auto.allowance_s(False, auto.gain_with) == pytest.approx(0.02)
    assert auto.decide(busy=False) is Next.DRAFT
    auto.reply_s = 0.025  # the answer comes too late to pay: the server runs on alone
    assert auto.decide(busy=False) is Next.REST


def test_auto_weighs_the_larger_forward_a_merged_draft_brings():
    """A forward on a draft takes 30 ms against 20 alone: the allowance shrinks by 10 ms."""
    auto = measured(2.4, 1.2)
    auto.with_s = 0.03
    assert auto.allowance_s(False, auto.gain_with) == pytest.approx(0.01)


def test_auto_rests_a_client_whose_drafts_add_nothing_even_under_load():
    """Where the server's own candidates commit as much as the forwards on drafts, no wait
    pays, however short; under load drafts that add tokens get LOADED_WAIT_STEPS steps."""
    auto = measured(1.5, 1.5, reply_s=0.001)
    assert auto.decide(busy=False) is Next.REST
    assert auto.decide(busy=True) is Next.REST
    auto = measured(1.6, 1.5, reply_s=0.05)
    assert auto.decide(busy=False) is Next.REST
    assert auto.allowance_s(True, auto.gain_with) == LOADED_WAIT_STEPS * auto.step_s
    assert auto.decide(busy=True) is Next.DRAFT


def test_auto_starts_from_the_clients_round_trip():
    """With no draft measured, the prior (2.0 against 1.2 tokens) allows 0.67 of a step: a
    client on a link slower than that is told to rest from the first Verdict, so the
    prompt's rows never cross it; one with no round trip known is asked for a draft."""
    assert AutoPace(0.03, None).decide(busy=False) is Next.DRAFT
    assert AutoPace(0.03, 0.005).decide(busy=False) is Next.DRAFT
    assert AutoPace(0.03, 0.1).decide(busy=False) is Next.REST


def test_one_unlucky_draft_does_not_end_the_drafting():
    """The prior counts as two forwards: a first draft that added nothing leaves the gain
    between the prior and it, and the client is asked again."""
    auto = AutoPace(0.02, 0.004)
    auto.forwarded(tokens=1, alone=1, drafted=True)
    assert 1.0 < auto.gain_with < 2.0
    assert auto.decide(busy=False) is Next.DRAFT
    for _ in range(20):
        auto.forwarded(tokens=1, alone=1, drafted=True)
    assert auto.decide(busy=False) is Next.REST


def test_at_rest_auto_probes_ever_more_seldom():
    """After PROBE_GAP forwards at rest it asks once (a probe), then waits twice as long, up
    to MAX_PROBE_GAP; a draft that pays again ends the rest."""
    auto = measured(1.3, 1.25, reply_s=0.01)
    gaps, since = [], 0
    for _ in range(2000):
        since += 1
        if auto.decide(busy=False) is Next.DRAFT:
            gaps.append(since)
            since = 0
    assert gaps[:3] == [PROBE_GAP + 1, 2 * PROBE_GAP + 1, 4 * PROBE_GAP + 1]
    assert max(gaps) == MAX_PROBE_GAP + 1
    auto.gain_with = 3.0
    assert auto.decide(busy=False) is Next.DRAFT and auto.probe_gap == PROBE_GAP


def test_no_probe_where_even_the_best_draft_could_not_pay_the_round_trip():
    """A round trip of 3 steps: a draft of GAIN_CEILING tokens against 1.2 would be worth
    (3.0 / 1.2 - 1) steps of wait at most, so the client is never asked."""
    auto = measured(1.3, 1.2, step_s=0.02, reply_s=0.06)
    assert (GAIN_CEILING / 1.2 - 1) * 0.02 < 0.06
    assert all(auto.decide(busy=False) is Next.REST for _ in range(4 * MAX_PROBE_GAP))


def test_auto_times_rounds_on_drafts_apart_from_its_own_and_leaves_the_wait_out():
    """A round runs from one Verdict sent to the next: the forward and the session's own work
    around it. The prefill's round is not timed."""
    auto = AutoPace(0.05, None)
    auto.sent(10, Next.DRAFT, now=100.0)  # the prefill's Verdict
    assert auto.step_s == 0.05
    auto.forwarded(tokens=1, alone=1, drafted=False)
    auto.sent(11, Next.DRAFT, now=100.02)
    assert auto.step_s == pytest.approx(0.05 * 0.8 + 0.02 * 0.2)
    auto.forwarded(tokens=3, alone=1, drafted=True)
    auto._waited = 0.01  # as wait() sets it
    auto.sent(14, Next.DRAFT, now=100.06)
    assert auto.with_s == pytest.approx(0.03)
    assert auto.gain_alone < 1.2  # its own candidates committed nothing but the token


def wait_s(rule: PaceRule, inbox: Inbox, committed: int) -> float:
    async def timed() -> float:
        start = asyncio.get_running_loop().time()
        await rule.wait(inbox, committed, busy=False)
        return asyncio.get_running_loop().time() - start
    return asyncio.run(timed())


def test_auto_waits_for_the_draft_it_asked_for_within_its_allowance_and_measures_it():
    auto = measured(2.4, 1.2, reply_s=0.01)
    told = auto.decide(busy=False)
    auto.sent(10, told, now=time.monotonic())
    inbox = Inbox(acked=9)
    assert 0.015 <= wait_s(auto, inbox, 10) <= 0.5  # nobody answered: the allowance, 20 ms
    rested = measured(1.0, 1.2)
    rested.sent(10, rested.decide(busy=False), now=0.0)
    assert wait_s(rested, Inbox(acked=9), 10) < 0.01  # it said rest: nothing to wait for


def test_the_reply_time_is_measured_from_the_answer():
    auto = AutoPace(0.02, None)
    auto.decide(busy=False)
    inbox = Inbox(acked=9)
    auto.sent(10, Next.DRAFT, now=inbox.acked_at - 0.5)
    inbox.put(DraftRequest(1, 10, DraftTree((), ())), committed=10)
    wait_s(auto, inbox, 10)
    assert auto.reply_s == pytest.approx(inbox.acked_at - (inbox.acked_at - 0.5), abs=0.05)


def test_lockstep_and_server_pace_always_ask_for_a_draft():
    assert Lockstep().decide(busy=False) is Next.DRAFT
    assert ServerPace().decide(busy=True) is Next.DRAFT
    assert PaceRule().decide(busy=False) is None  # no client: nothing to tell


def test_the_server_remembers_what_auto_learned_of_each_client():
    memory = PaceMemory(size=2)
    first = memory.rule("a", Pace.AUTO, 0.002, 0.02)
    assert isinstance(first, AutoPace) and first.measured == 0
    first.forwarded(tokens=1, alone=1, drafted=True)
    first.sent(20, Next.DRAFT, now=100.0)
    memory.keep("a", first)
    again = memory.rule("a", Pace.AUTO, 0.002, 0.02)
    assert again is not first and again.measured == 1 and again.gain_with == first.gain_with
    again.sent(12, Next.DRAFT, now=160.0)  # the next session's prefill, a minute later
    assert again.step_s == first.step_s  # the time between sessions is no round
    assert memory.rule("b", Pace.AUTO, None, 0.02).measured == 0  # another client
    memory.keep("b", memory.rule("b", Pace.AUTO, None, 0.02))
    memory.keep("c", memory.rule("c", Pace.AUTO, None, 0.02))
    assert memory.rule("a", Pace.AUTO, None, 0.02).measured == 0  # the oldest went
    assert isinstance(memory.rule("a", Pace.LOCKSTEP, None, 0.02), Lockstep)
    assert isinstance(memory.rule("a", Pace.SERVER, None, 0.02), ServerPace)


def test_policy_caps_the_lead_and_fills_defaults():
    policy = PacingPolicy(pace=Pace.AUTO, lead=64, max_lead=100)
    assert policy.resolve(None, 0) == (Pace.AUTO, 64)
    assert policy.resolve(Pace.SERVER, 500) == (Pace.SERVER, 100)
    assert policy.resolve(Pace.LOCKSTEP, 8) == (Pace.LOCKSTEP, 8)
