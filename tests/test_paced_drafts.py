"""The edge's side of a paced session (edge_client/paced_drafts.py): when a draft is due, when an
acknowledgement may stay unsent while the server says rest, and what became of each draft."""
from __future__ import annotations

from edge_client.paced_drafts import ACKS_PER_LEAD, DraftFollower
from edge_client.reporting import DraftOutcomes
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
    assert follower.due(context)  # spent: a new draft is due


def test_a_draft_is_due_once_the_text_leaves_it_or_passes_it():
    follower = DraftFollower()
    sent(follower, 2, DraftTree.chain([3, 4]))
    assert not follower.due([1, 2, 3])  # still continues the text: the server re-roots it
    assert follower.due([1, 2, 3, 4, 5, 6])  # right to its leaf, but the server is past it
    sent(follower, 2, DraftTree.chain([3, 4]))
    assert follower.due([1, 2, 9, 9])  # another text
    assert follower.due([1, 2, 9, 9])  # no live draft: always due


def test_the_follower_counts_what_became_of_each_draft():
    """Used (earned or not), late (right as far as the text went, passed before a forward
    used it) or wrong (left at its first token); a draft still live is none of these."""
    outcomes = DraftOutcomes()
    follower = DraftFollower(outcomes)
    draft = sent(follower, 2, DraftTree.chain([3, 4]))
    follower.verified(Verdict(1, (0,), (3, 5), 4, draft_id=draft.round_id), [1, 2])
    draft = sent(follower, 4, DraftTree.chain([6, 7]))
    follower.verified(Verdict(1, (), (8,), 5, draft_id=draft.round_id), [1, 2, 3, 5])
    sent(follower, 5, DraftTree.chain([9, 10]))
    follower.due([1, 2, 3, 5, 8, 9, 11])  # late: right at 9, past it by 11
    sent(follower, 7, DraftTree.chain([12]))
    follower.due([1, 2, 3, 5, 8, 9, 11, 13])  # wrong from its first token
    sent(follower, 8, DraftTree.chain([14]))
    assert not follower.due([1, 2, 3, 5, 8, 9, 11, 13])  # live: not settled
    assert outcomes == DraftOutcomes(used=2, earned=1, late=1, wrong=1)
    assert outcomes.settled == 4


def test_a_resting_edge_acknowledges_once_per_quarter_of_the_lead_or_with_news_of_rows():
    follower = DraftFollower()
    assert follower.last_base == 0

    def ack(base: int, rows: int | None = 10) -> DraftRequest:
        return DraftRequest(0, base, DraftTree((), ()), rows_held=rows)

    def needless(draft: DraftRequest) -> bool:
        return follower.needless(draft, lead=128)
    assert not needless(ack(10))  # nothing sent yet
    follower.sent(ack(10))
    assert follower.last_base == 10
    assert needless(ack(11))
    assert needless(ack(10 + 128 // ACKS_PER_LEAD - 1))
    assert not needless(ack(10 + 128 // ACKS_PER_LEAD))  # the lead nears
    assert not needless(ack(12, rows=12))  # the edge holds new rows
    assert not follower.needless(ack(11), lead=0)  # no lead known: every answer goes
