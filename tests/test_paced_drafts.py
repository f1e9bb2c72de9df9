"""The edge's side of a server-paced session (edge_client/paced_drafts.py): when a draft is due,
when the edge rests from drafting, and what became of each draft."""
from __future__ import annotations

import pytest

from edge_client.paced_drafts import (
    ACKS_PER_LEAD, CARRY_GENERATIONS, FASTER_LINK, FIRST_REST, MAX_CARRY, MAX_REST, PATIENCE,
    DraftFollower, DraftOutcomes, DraftSpacing,
)
from edge_client.reporting import GenerationResult
from shared.messages import DraftRequest, Verdict
from shared.tree import DraftTree


def sent(follower: DraftFollower, base: int, tree: DraftTree) -> DraftRequest:
    return follower.sent(DraftRequest(0, base, tree))


def test_a_used_draft_is_spent_and_comes_back_rerooted():
    follower = DraftFollower()
    draft = sent(follower, 3, DraftTree.chain([4, 5, 6, 7]))
    context = [1, 2, 3, 4, 5]  # the server committed two tokens before the forward that used it
    verified = follower.verified(Verdict(1, (0,), (6, 7), 7, draft_id=draft.round_id), context)
    assert verified == DraftTree.chain([6, 7])
    assert follower.due(context, link_slow=True)  # spent: a new draft is due


def test_a_draft_is_due_once_the_text_leaves_it_or_passes_it():
    follower = DraftFollower()
    sent(follower, 2, DraftTree.chain([3, 4]))
    assert not follower.due([1, 2, 3], link_slow=True)  # still continues the text
    # right to its leaf, but the server is past it
    assert follower.due([1, 2, 3, 4, 5, 6], link_slow=True)
    sent(follower, 2, DraftTree.chain([3, 4]))
    assert follower.due([1, 2, 9, 9], link_slow=True)  # another text
    assert follower.due([1, 2, 9, 9], link_slow=True)  # no live draft: always due


def chances_until_a_draft(spacing: DraftSpacing) -> int:
    """The chances that pass before the edge drafts (at most 1000)."""
    return next(i for i in range(1000) if spacing.chance())


def test_overtaken_drafts_make_the_edge_rest_longer_up_to_a_bound():
    spacing = DraftSpacing()
    for _ in range(PATIENCE - 1):
        spacing.overtaken(link_slow=True)
    assert not spacing.resting and chances_until_a_draft(spacing) == 0
    spacing.overtaken(link_slow=True)
    assert spacing.resting  # so it wants no rows either
    assert chances_until_a_draft(spacing) == FIRST_REST
    assert spacing.resting  # the probe goes without the rows
    spacing.overtaken(link_slow=True)  # the probe earned nothing
    assert chances_until_a_draft(spacing) == 2 * FIRST_REST
    spacing.missed()  # a probe wrong from its first node rests as long again
    assert spacing.resting and chances_until_a_draft(spacing) == 2 * FIRST_REST
    for _ in range(20):
        spacing.overtaken(link_slow=True)
    assert chances_until_a_draft(spacing) == MAX_REST  # still probes
    spacing.earned()
    assert not spacing.resting and chances_until_a_draft(spacing) == 0
    spacing.missed()  # outside a rest a wrong draft says nothing
    assert not spacing.resting and chances_until_a_draft(spacing) == 0


@pytest.mark.parametrize("reads_rows", [False, True])
def test_a_text_only_edge_rests_from_drafts_the_servers_own_candidates_had(reads_rows):
    """Verdict.draft_redundant: a prompt-lookup edge's drafts that add nothing to the server's
    own lookup count as drafts that did not pay, as do wrong ones, and a probe that adds
    something ends the rest; an edge fed the server's rows keeps drafting (its rows are what
    it adds)."""
    follower = DraftFollower(DraftSpacing(reads_rows=reads_rows))

    def used(redundant: bool) -> None:
        draft = sent(follower, 3, DraftTree.chain([4, 5]))
        follower.verified(Verdict(1, (0,), (4, 5), 5, draft_id=draft.round_id,
                                  draft_redundant=redundant), [1, 2, 3])
    for _ in range(PATIENCE):
        used(redundant=True)
    assert follower.spacing.resting is not reads_rows
    assert chances_until_a_draft(follower.spacing) == (0 if reads_rows else FIRST_REST)
    used(redundant=False)  # the probe's tokens were the edge's own
    assert not follower.spacing.resting and chances_until_a_draft(follower.spacing) == 0
    for _ in range(PATIENCE):  # drafts wrong from their first node
        sent(follower, 3, DraftTree.chain([9]))
        assert follower.due([1, 2, 3, 4], link_slow=True)
    assert follower.spacing.resting is not reads_rows


RTT = 0.6  # a round trip far longer than the server's forward


def rested(spacing: DraftSpacing) -> DraftSpacing:
    """`spacing` after its drafts were overtaken until it rests."""
    for _ in range(PATIENCE + 1):
        spacing.overtaken(link_slow=True)
    return spacing


def test_the_next_generation_starts_resting_where_the_last_one_rested():
    assert not DraftSpacing().carried(outpaced=True, rtt_s=RTT).resting  # it drafts at once
    spacing = rested(DraftSpacing())
    # a fast link: the rest was by chance
    assert not spacing.carried(outpaced=False, rtt_s=RTT).resting
    for _ in range(CARRY_GENERATIONS):
        spacing = spacing.carried(outpaced=True, rtt_s=RTT)
        assert spacing.resting  # it opens with the rows paused
        assert chances_until_a_draft(spacing) == 2 * FIRST_REST  # as long as the next rest
    assert not spacing.carried(outpaced=True, rtt_s=RTT).resting  # then one learns afresh
    spacing = DraftSpacing()
    for _ in range(PATIENCE):
        spacing.overtaken(link_slow=True)
    spacing.earned()  # a draft earned, then the edge rested again before the end
    for _ in range(PATIENCE):
        spacing.overtaken(link_slow=True)
    assert spacing.resting and not spacing.carried(outpaced=True, rtt_s=RTT).resting


def carried_run(spacing: DraftSpacing, rtt_s: float = RTT) -> tuple[int, DraftSpacing]:
    """How many generations in a row open resting after `spacing`'s, on an unchanged link,
    and the one that learns it afresh (which rests again)."""
    run = 0
    while (spacing := spacing.carried(outpaced=True, rtt_s=rtt_s)).resting:
        run += 1
    return run, rested(spacing)


def test_a_link_that_stays_too_slow_is_learned_again_ever_more_seldom():
    """Each generation that learns the link afresh and rests again unpaid doubles the run of
    generations that open resting, up to MAX_CARRY; one whose drafts earn starts over."""
    spacing = rested(DraftSpacing())
    runs = []
    for _ in range(5):
        run, spacing = carried_run(spacing)
        runs.append(run)
    assert runs == [CARRY_GENERATIONS, 2 * CARRY_GENERATIONS, MAX_CARRY, MAX_CARRY, MAX_CARRY]
    spacing.earned()  # the generation that learned it earned: the link pays again
    assert not spacing.carried(outpaced=True, rtt_s=RTT).resting
    assert carried_run(rested(DraftSpacing()))[0] == CARRY_GENERATIONS


def test_a_link_that_got_faster_is_learned_afresh_at_once():
    """The round trip the rest was learned under is kept: a carried generation whose link's
    round trip fell below FASTER_LINK of it ends the run, whatever its length."""
    spacing = rested(DraftSpacing()).carried(outpaced=True, rtt_s=RTT)
    spacing = spacing.carried(outpaced=True, rtt_s=RTT * 1.2)  # slower still: rests on
    assert spacing.resting
    spacing = spacing.carried(outpaced=True, rtt_s=RTT * (FASTER_LINK + 0.05))  # jitter
    assert spacing.resting
    assert not spacing.carried(outpaced=True, rtt_s=RTT * (FASTER_LINK - 0.05)).resting


@pytest.mark.parametrize("rtt_s, rounds, outpaced", [(0.1, 9, True), (0.01, 9, False),
                                                     (0.1, 0, False)])
def test_a_link_is_outpaced_when_its_round_trip_passes_a_forward(rtt_s, rounds, outpaced):
    result = GenerationResult(rounds=rounds, verify_s=0.2 + 0.05 * rounds, prefill_s=0.2,
                              rtt_s=rtt_s)
    assert result.link_outpaced is outpaced


@pytest.mark.parametrize("rtt_s, slow", [(0.04, True), (0.02, False)])
def test_a_link_is_slow_when_no_wait_of_auto_pace_covers_its_round_trip(rtt_s, slow):
    """Auto pace waits for an answer at most half a forward: 25 ms of these 50 ms forwards."""
    result = GenerationResult(rounds=9, verify_s=0.2 + 0.05 * 9, prefill_s=0.2, rtt_s=rtt_s)
    assert result.link_slow is slow and not result.link_outpaced


def test_a_long_prefill_does_not_lift_the_line_a_slow_link_is_drawn_at():
    """Three 50 ms forwards after a 600 ms prefill: a 40 ms round trip is past half of one.
    Counted as a forward, the prefill put the line at 94 ms, and a `5g` edge kept drafting
    where auto pace could never wait for it."""
    result = GenerationResult(rounds=3, verify_s=0.6 + 0.15, prefill_s=0.6, rtt_s=0.04)
    assert result.link_slow


def test_the_follower_rests_after_overtaken_drafts_and_not_after_wrong_ones():
    follower = DraftFollower()
    for i in range(PATIENCE - 1):  # right to their leaf, but the server got there first
        sent(follower, 2, DraftTree.chain([3, 4]))
        assert follower.due([1, 2, 3, 4, 5, 6 + i], link_slow=True)
    for i in range(3):  # wrong from their first node: they say nothing of the link
        sent(follower, 2, DraftTree.chain([3, 4]))
        assert follower.due([1, 2, 9, 9 + i], link_slow=True)
        draft = sent(follower, 2, DraftTree.chain([3, 4]))
        follower.verified(Verdict(1, (), (9,), 3, draft_id=draft.round_id), [1, 2])
    assert not follower.spacing.resting
    sent(follower, 2, DraftTree.chain([3, 4]))
    # right at first: a faster link would have had it
    assert follower.due([1, 2, 3, 7, 5], link_slow=True)
    assert follower.spacing.resting
    draft = sent(follower, 2, DraftTree.chain([3, 4]))
    follower.verified(Verdict(1, (0,), (3, 4), 4, draft_id=draft.round_id), [1, 2])
    assert not follower.spacing.resting


def test_the_follower_counts_what_became_of_each_draft():
    """Used (earned or not), late (right as far as the text went, passed before a forward
    used it) or wrong (left at its first token); a draft still live is none of these."""
    outcomes = DraftOutcomes()
    follower = DraftFollower(outcomes=outcomes)
    draft = sent(follower, 2, DraftTree.chain([3, 4]))
    follower.verified(Verdict(1, (0,), (3, 5), 4, draft_id=draft.round_id), [1, 2])
    draft = sent(follower, 4, DraftTree.chain([6, 7]))
    follower.verified(Verdict(1, (), (8,), 5, draft_id=draft.round_id), [1, 2, 3, 5])
    sent(follower, 5, DraftTree.chain([9, 10]))
    follower.due([1, 2, 3, 5, 8, 9, 11], link_slow=True)  # late: right at 9, past it by 11
    sent(follower, 7, DraftTree.chain([12]))
    follower.due([1, 2, 3, 5, 8, 9, 11, 13], link_slow=True)  # wrong from its first token
    sent(follower, 8, DraftTree.chain([14]))
    assert not follower.due([1, 2, 3, 5, 8, 9, 11, 13], link_slow=True)  # live: not settled
    assert outcomes == DraftOutcomes(used=2, earned=1, late=1, wrong=1)
    assert outcomes.settled == 4


@pytest.mark.parametrize("reads_rows", [True, False])
def test_drafts_overtaken_on_a_fast_link_rest_only_a_text_only_edge(reads_rows):
    """Where a draft sent on a Verdict arrives before the next forward ends, an overtaken draft
    is the server's choice not to wait (its auto pace measures the drafts again later), not
    the link's: an edge fed the server's rows keeps drafting; one that reads the text alone
    rests, since the server's own lookup had those tokens."""
    follower = DraftFollower(DraftSpacing(reads_rows=reads_rows))
    for i in range(PATIENCE):
        sent(follower, 2, DraftTree.chain([3, 4]))
        assert follower.due([1, 2, 3, 4, 5, 6 + i], link_slow=False)
    assert follower.spacing.resting is not reads_rows
    assert chances_until_a_draft(follower.spacing) == (0 if reads_rows else FIRST_REST)


def test_a_resting_edge_acknowledges_once_per_quarter_of_the_lead():
    follower = DraftFollower()

    def ack(base: int, paused: bool = True) -> DraftRequest:
        return DraftRequest(0, base, DraftTree((), ()), rows_paused=paused)

    def needless(draft: DraftRequest) -> bool:
        return follower.needless(draft, lead=128, awaited=True)
    assert not needless(ack(10))  # the server must learn that it rests
    follower.sent(ack(10))
    assert needless(ack(11))
    assert needless(ack(10 + 128 // ACKS_PER_LEAD - 1))
    assert not needless(ack(10 + 128 // ACKS_PER_LEAD))  # the lead nears
    assert not needless(ack(11, paused=False))  # done resting
    assert not needless(DraftRequest(0, 11, DraftTree.chain([3]), rows_paused=True))  # a draft
    follower.sent(ack(12, paused=False))
    assert not needless(ack(13))  # a new rest: say so at once


def test_an_answer_the_server_does_not_await_goes_only_with_news():
    """Verdict.answer_awaited unset (server pace; auto where drafts do not pay): a mere
    acknowledgement waits for the quarter lead, unless it says the edge holds new rows."""
    follower = DraftFollower()

    def ack(base: int, rows: int | None = None) -> DraftRequest:
        return DraftRequest(0, base, DraftTree((), ()), rows_held=rows)
    follower.sent(ack(10, rows=10))
    assert follower.needless(ack(12, rows=10), lead=128, awaited=False)
    assert not follower.needless(ack(12, rows=10), lead=128, awaited=True)
    assert not follower.needless(ack(12, rows=12), lead=128, awaited=False)  # rows: news
    assert not follower.needless(ack(10 + 128 // ACKS_PER_LEAD, rows=10), lead=128,
                                 awaited=False)
    assert not follower.needless(DraftRequest(0, 12, DraftTree.chain([3]), rows_held=10),
                                 lead=128, awaited=False)  # a draft always goes
