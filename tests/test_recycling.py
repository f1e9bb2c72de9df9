"""Token Recycling (cloud_server/decoding/recycling.py): trees grown from the target's recycled top-k, the
text's followers before the target has spoken, ranks learned from verdicts, and the session
handing every forward's top-k to the drafter."""
from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_server.decoding.recycling import RecyclingDrafter
from cloud_server.decoding.session import Session
from edge_client.client import ClientOptions
from shared.draft_q import Proposal
from shared.drafting.trie import TokenTrie
from shared.messages import Limits, OpenRequest
from shared.tree import ROOT, DraftTree


def table(drafter: RecyclingDrafter, rows: dict[int, list[int]]) -> None:
    drafter.recycle(list(rows), np.array(list(rows.values())))


def test_tree_follows_the_recycled_successors_best_first() -> None:
    drafter = RecyclingDrafter(top_k=2)
    table(drafter, {1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [8, 9]})
    tree = drafter.propose([9, 1], max_nodes=6)
    # by the prior, rank 0 is right twice as often as rank 1: the best six nodes of the table
    assert tree.tokens[0] == 2 and sorted(tree.tokens) == [2, 3, 4, 5, 6, 8]
    assert tree.path_tokens(tree.tokens.index(8)) == [2, 4, 8]
    tree.validate(vocab_size=10, max_nodes=6, max_depth=8)


def test_depth_and_node_budget_are_kept() -> None:
    drafter = RecyclingDrafter(max_depth=2, top_k=2)
    table(drafter, {t: [t + 1, t + 2] for t in range(20)})
    tree = drafter.propose([0], max_nodes=50)
    assert max(tree.depths()) == 1 and len(tree) == 2 + 4
    assert len(drafter.propose([0], max_nodes=3)) == 3


def test_unseen_tokens_fall_back_on_what_followed_them_in_the_text() -> None:
    drafter = RecyclingDrafter(top_k=4)
    drafter.reset([5, 6, 7, 5, 8])
    assert list(drafter.successors(5)) == [8, 6]  # most recent first
    table(drafter, {5: [1, 2, 3, 4]})
    assert list(drafter.successors(5)) == [1, 2, 3, 4]  # the target's word wins
    assert drafter.propose([3], max_nodes=4) == DraftTree((), ())  # nothing known after 3
    drafter.propose([6, 2, 6], max_nodes=4)  # a shorter text: another one
    assert list(drafter.successors(6)) == [2] and list(drafter.successors(7)) == []


def test_repeated_text_adds_prompt_lookup_nodes() -> None:
    """Where the text repeats itself, the tree also copies what followed the last time."""
    drafter = RecyclingDrafter(top_k=2)
    text = [1, 2, 3, 4, 9, 1, 2]
    drafter.reset(text)
    table(drafter, {2: [7, 8], 7: [6, 5]})
    tree, before = drafter.propose(text, max_nodes=8), drafter.rank_rates()
    assert tree.path_tokens(tree.tokens.index(4)) == [3, 4]  # lookup: 3, 4 followed 1, 2
    assert tree.tokens[0] == 7  # the recycled successors come first
    drafter.observe(text, tree, (tree.tokens.index(3),), (3, 4))  # a lookup node: no rank
    assert drafter.rank_rates()[0] < before[0]  # rank 0 (7) was offered, not taken


def test_verdicts_teach_which_ranks_are_right() -> None:
    drafter = RecyclingDrafter(top_k=2)
    table(drafter, {1: [2, 3], 2: [4, 5], 3: [6, 7]})
    before = drafter.rank_rates()
    for _ in range(20):
        tree = drafter.propose([1], max_nodes=2)  # 2 and 3, both children of the root
        drafter.observe([1], tree, (tree.tokens.index(3),), (3, 6))
    after = drafter.rank_rates()
    assert after[1] > before[1] and after[0] < before[0]
    assert drafter.propose([1], max_nodes=1).tokens == (3,)  # rank 1 now comes first


def test_the_session_hands_every_forward_its_top_k(tiny_target) -> None:
    """In greedy decoding the top-1 after the pending token is the token committed next."""
    session = Session.open(tiny_target, Limits(),
                           OpenRequest(prompt_ids=(5, 6, 7), max_new_tokens=6))
    seen: list[tuple[list[int], np.ndarray]] = []
    session.watch_successors(3, lambda inputs, top: seen.append((list(inputs), top)))
    session.prefill()
    tree = DraftTree.chain([1, 2])
    session.advance(Proposal(tree))
    (first_in, first_top), (step_in, step_top) = seen
    assert first_in == [7] and first_top.shape == (1, 3)
    assert first_top[0, 0] == session.committed[3]
    assert step_in == [session.committed[3], 1, 2] and step_top.shape == (3, 3)
    assert step_top[0, 0] == session.committed[4]


def test_the_edge_cannot_draft_with_recycling() -> None:
    with pytest.raises(ValueError, match="only the server runs it"):
        ClientOptions("recycle")


def grown_by_full_heap(drafter: RecyclingDrafter, context: list[int], max_nodes: int
                       ) -> TokenTrie:
    """The definition: every expanded node pushes its whole successor list, ties to the
    earlier push."""
    rates = drafter.rank_rates()
    trie, order, heap = TokenTrie(), itertools.count(), []

    def push(parent: int, token: int, score: float, depth: int) -> None:
        if depth < drafter.max_depth:
            for rank, child in enumerate(drafter.successors(token)):
                heapq.heappush(heap, (-score * rates[rank], next(order), parent, int(child),
                                      depth + 1))

    if context:
        push(ROOT, context[-1], 1.0, 0)
    while heap and len(trie) < max_nodes:
        neg, _, parent, token, depth = heapq.heappop(heap)
        push(trie.add(parent, token, -neg), token, -neg, depth)
    return trie


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_trees_equal_the_full_heaps_on_random_tables(data: st.DataObject) -> None:
    """Random tables, learned rates (not falling with rank, and tied, too), depths and
    budgets: the lazy heap keeps the same nodes in the same order, and so the same q."""
    vocab, top_k = 12, data.draw(st.integers(1, 4))
    drafter = RecyclingDrafter(max_depth=data.draw(st.integers(1, 6)), top_k=top_k,
                               lookup_nodes=0)
    rows = {t: data.draw(st.permutations(range(vocab)))[:top_k]
            for t in data.draw(st.sets(st.integers(0, vocab - 1)))}
    if rows:
        table(drafter, rows)
    context = data.draw(st.lists(st.integers(0, vocab - 1), max_size=10))
    drafter._index(context)
    drafter._offered[:] = data.draw(st.lists(st.sampled_from([0, 1, 2, 4]), min_size=top_k,
                                             max_size=top_k))
    drafter._hits[:] = [data.draw(st.integers(0, int(n))) for n in drafter._offered]
    max_nodes = data.draw(st.integers(0, 40))
    full = grown_by_full_heap(drafter, context, max_nodes)
    assert drafter.propose(context, max_nodes) == full.best_tree(max_nodes)
    drawn = drafter.propose_sampled(context, max_nodes, np.random.default_rng(0))
    assert drawn == full.sampled_tree(max_nodes, np.random.default_rng(0))
