"""The pieces the edge uses to survive a bad link, one by one: offline drafting and
reconciliation, backoff, pipelined speculation, and the server's table of held sessions."""
from __future__ import annotations

import random

import pytest

from cloud_server.decoding.session_table import SessionTable
from shared.drafting.pld import PromptLookupDrafter
from edge_client.generation_drafts import GenerationDrafts
from edge_client.offline import Backoff, LinkPolicy, draft_offline, reconcile
from edge_client.pipelined_drafting import Speculation
from edge_client.reporting import GenerationResult, SilentListener
from shared.drafting.budget import TreeBudget
from shared.errors import Overloaded
from shared.messages import Limits
from shared.tree import DraftTree


@pytest.mark.parametrize("offline, committed, pending, rewound", [
    ([1, 2, 3], [1], [2, 3], 0),  # a catch-up token that the offline text also had
    ([1, 2, 3], [1, 2, 3], [], 0),  # all confirmed
    ([1, 2, 3], [1, 2, 3, 4], [], 0),  # confirmed, plus the target's own next token
    ([1, 2, 3], [1, 9], [], 2),  # diverges at the second: that one and the rest rewound
    ([1, 2, 3], [7], [], 3),
    ([], [5, 6], [], 0),
    ([1, 2], [], [1, 2], 0),
])
def test_reconcile_keeps_the_agreed_prefix_and_rewinds_the_rest(offline, committed, pending,
                                                                 rewound):
    assert reconcile(offline, committed) == (pending, rewound)


def test_each_offline_token_is_counted_once_as_kept_or_rewound():
    result = GenerationResult()
    drafts = GenerationDrafts(PromptLookupDrafter(), TreeBudget([(1, 1.0)], 8), result,
                              SilentListener(), Limits(), None)
    drafts.offline = [1, 2, 3, 4, 5]
    drafts.committed([1, 2])  # a resume's catch-up confirms two
    assert (result.kept_tokens, result.corrected_tokens, drafts.offline) == (2, 0, [3, 4, 5])
    drafts.committed([3, 9])  # the check of the rest keeps one and rewinds two
    assert (result.kept_tokens, result.corrected_tokens, drafts.offline) == (3, 2, [])
    drafts.committed([7])  # committed text with no offline text left counts for neither
    assert (result.kept_tokens, result.corrected_tokens) == (3, 2)


def test_offline_drafting_follows_the_best_path_up_to_the_room():
    drafter = PromptLookupDrafter()
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    drafter.reset(text)
    assert draft_offline((drafter,), text, 3) == [4, 5, 6]
    # the loop goes round once: the next token would repeat the 4-gram 1 2 3 4 it wrote
    assert draft_offline((drafter,), text, 20) == [4, 5, 6, 1, 2, 3]
    assert draft_offline((drafter,), [7, 8, 9], 5) == []  # nothing to look up: nothing drafted
    # resumed mid-outage: what was written offline already counts, what was committed not
    assert draft_offline((drafter,), [*text, 4, 5, 6], 20, offline_from=len(text)) == [1, 2, 3]
    assert draft_offline((drafter,), [*text, 4, 5, 6], 20) == [1, 2, 3, 4, 5, 6]


class Looping:
    """A drafter whose best child always returns to the same token pair: 8 9 8 9 ..., with
    7 second at every node."""

    def propose(self, context, max_nodes: int) -> DraftTree:
        best = 9 if context[-1] == 8 else 8
        return DraftTree((best, 7), (-1, -1))


def test_offline_text_takes_the_next_child_where_the_best_would_repeat():
    drafted = draft_offline((Looping(),), [1, 2, 3], 8)
    # 8 9 8 9 8, then 9 would repeat 8 9 8 9: 7, the second child, instead
    assert drafted[:6] == [8, 9, 8, 9, 8, 7] and len(drafted) == 8
    grams = [tuple(drafted[i:i + 4]) for i in range(len(drafted) - 3)]
    assert len(grams) == len(set(grams))


def test_backoff_grows_to_its_cap_with_jitter():
    policy = LinkPolicy(backoff_initial_s=0.1, backoff_max_s=1.0)
    backoff = Backoff(policy, random.Random(0))
    waits = [backoff.next_wait_s() for _ in range(8)]
    caps = [min(1.0, 0.1 * 2 ** i) for i in range(8)]
    assert all(cap / 2 <= w <= cap for w, cap in zip(waits, caps))
    assert len(set(waits)) == len(waits)


def test_tree_best_path_and_subtree():
    tree = DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 0, 2))
    assert tree.best_path() == [5, 7, 9]
    assert tree.subtree(0) == DraftTree((7, 8, 9), (-1, -1, 0))
    assert tree.subtree(1) == DraftTree((), ())
    assert DraftTree((), ()).best_path() == []


def test_speculation_is_kept_only_when_it_came_true():
    drafter = PromptLookupDrafter()
    text = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    drafter.reset(text)
    sent = DraftTree.chain([3, 4])
    spec = Speculation.draft(drafter, text, sent, 8)
    assert spec.path == (3, 4)
    assert spec.next_tree([3, 4, 5]).best_path()[:2] == [6, 7]  # path and guess right
    assert spec.next_tree([3, 4, 9]) is None  # the target's own token not among the guesses
    assert spec.next_tree([3, 5]) is None  # path not accepted in full
    assert Speculation.draft(drafter, text, DraftTree((), ()), 8) is None


class FakeSession:
    def __init__(self, sid: str):
        self.id = sid
        self.epoch = 0


def test_session_table_holds_orphans_for_the_idle_timeout_then_evicts():
    now = [0.0]
    table = SessionTable(Limits(max_sessions=2, session_idle_timeout_s=10), clock=lambda: now[0])
    a, b = FakeSession("a"), FakeSession("b")
    first, second = object(), object()
    table.add(a, first)
    table.add(b, first)
    with pytest.raises(Overloaded):
        table.reserve()
    table.detach(a, first)
    assert table.take_over("a", second) is a  # a resume takes the orphan
    assert a.epoch == 1  # work the old stream handed in runs no forward now
    assert not table.owns(a, first) and table.owns(a, second)
    table.release(a, first)  # the old stream ending late changes nothing
    assert "a" in table
    table.detach(a, second)
    now[0] = 11.0
    table.reserve()  # the orphan expired and made room
    assert "a" not in table and "b" in table  # an owned session is never evicted
    assert table.take_over("a", second) is None


def test_session_table_at_its_limit_drops_finished_orphans_first():
    table = SessionTable(Limits(max_sessions=2, session_idle_timeout_s=300))
    done, live = FakeSession("done"), FakeSession("live")
    done.finished = live.finished = True
    owner = object()
    table.add(done, owner)
    table.add(live, owner)
    table.detach(done, owner)  # finished, its stream gone: most likely nobody will resume it
    table.reserve()
    assert "done" not in table and "live" in table  # an owned session stays, finished or not


def test_session_table_admits_by_kv_budget_and_frees_finished_orphans():
    table = SessionTable(Limits(max_sessions=8, session_idle_timeout_s=300),
                         kv_budget_bytes=100)
    a, b, c = FakeSession("a"), FakeSession("b"), FakeSession("c")
    a.finished = b.finished = False
    owner = object()
    table.add(a, owner, kv_bytes=60)
    with pytest.raises(Overloaded, match="retry"):
        table.add(b, owner, kv_bytes=50)  # 110 > 100: refused, nothing squeezed
    assert "a" in table and "b" not in table and table.kv_bytes == 60
    table.add(b, owner, kv_bytes=40)  # fits exactly
    a.finished = True
    table.detach(a, owner)  # a finished orphan gives its room back when room is needed
    table.add(c, owner, kv_bytes=50)
    assert "a" not in table and table.kv_bytes == 90


def test_server_accepts_the_edge_keepalive_pings():
    """A server that allows fewer pings than the edge sends answers GOAWAY too_many_pings."""
    from cloud_server.rpc.frontend import server_options
    from edge_client.link import LinkConfig, channel_options
    from shared.messages import Limits

    client = dict(channel_options(LinkConfig()))
    server = dict(server_options(Limits().max_message_bytes))
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == 1


class Counting:
    """A drafter that always continues with the next integer."""

    def propose(self, context, max_nodes: int) -> DraftTree:
        return DraftTree((context[-1] + 1,), (-1,))


def test_offline_the_edge_copies_the_texts_own_continuation_first():
    """Where prompt lookup finds one it takes it (LOG offline_text), the drafter elsewhere."""
    import asyncio

    drafts = GenerationDrafts(Counting(), TreeBudget([(1, 1.0)], 8), GenerationResult(),
                              SilentListener(), Limits(), None)
    text = [50, 1, 2, 3, 60, 1, 2]  # "1 2" came before, then 3
    asyncio.run(drafts.draft_offline(text, 4, LinkPolicy()))
    assert drafts.offline[:2] == [3, 60]  # copied, not counted on from 2


class _Timed(TreeBudget):
    """A tree budget that records the drafting time each lock-step round hands it."""

    def __init__(self) -> None:
        super().__init__([(1, 1.0)], 8)
        self.drafted: list[float | None] = []

    def observe(self, sent, accepted_nodes, round_ms, verify_ms, draft_ms=None) -> None:
        self.drafted.append(draft_ms)
        super().observe(sent, accepted_nodes, round_ms, verify_ms, draft_ms)


def test_a_lockstep_round_tells_the_budget_its_drafting_time_unless_drafted_ahead():
    """The budget weighs a tree's nodes by the time drafting them took (budget.py,
    CostLine); a tree drafted while the last round was away cost the round nothing."""
    import asyncio

    from shared.messages import Verdict

    budget = _Timed()
    drafts = GenerationDrafts(PromptLookupDrafter(), budget, GenerationResult(),
                              SilentListener(), Limits(), None)
    context = [5, 6, 7]
    tree = asyncio.run(drafts.next_tree(context)).tree
    drafts.sent()
    drafts.learn(context, tree, Verdict(1, (0,), (8, 9), 5), lockstep=True)
    drafts._ready_tree = DraftTree((10,), (-1,))  # as a speculation that came true leaves it
    ahead = asyncio.run(drafts.next_tree([5, 6, 7, 8, 9])).tree
    drafts.sent()
    drafts.learn([5, 6, 7, 8, 9], ahead, Verdict(2, (0,), (10, 11), 7), lockstep=True)
    assert len(budget.drafted) == 2 and budget.drafted[0] is not None
    assert budget.drafted[0] >= 0 and budget.drafted[1] is None
