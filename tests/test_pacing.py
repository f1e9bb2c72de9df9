"""The wait policies' rules (cloud_server/decoding/pacing.py): when auto pace waits for the client's
answer, what it learns from each forward, and the server's pacing defaults. The loop that asks
them: test_decode_loop.py."""
from __future__ import annotations

import pytest

from cloud_server.decoding.pacing import LEARNING_FORWARDS, RELEARN_AFTER, AutoPace, PacingPolicy
from shared.messages import Pace


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
