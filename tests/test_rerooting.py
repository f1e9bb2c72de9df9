"""Re-rooting a draft at the server's committed position (shared/rerooting.py)."""
from __future__ import annotations

import pytest

from shared.draft_q import NodeQ
from shared.rerooting import reroot
from shared.tree import DraftTree

# 5 -> 6 -> 7          nodes 0, 1, 3
#   -> 8 -> 9          nodes 0, 2, 4
# 10                   node 5
TREE = DraftTree((5, 6, 8, 7, 9, 10), (-1, 0, 0, 1, 2, -1))
PROMPT = [1, 2, 3]


def test_nothing_committed_since_the_base_keeps_the_whole_draft():
    got = reroot(TREE, len(PROMPT), PROMPT)
    assert got.proposal.tree == TREE and got.nodes == tuple(range(len(TREE)))


def test_the_subtree_below_the_committed_tokens_continues_the_text():
    got = reroot(TREE, len(PROMPT), [*PROMPT, 5])
    assert got.proposal.tree == DraftTree((6, 8, 7, 9), (-1, -1, 0, 1))
    assert got.nodes == (1, 2, 3, 4)
    deeper = reroot(TREE, len(PROMPT), [*PROMPT, 5, 8])
    assert deeper.proposal.tree == DraftTree((9,), (-1,)) and deeper.nodes == (4,)


@pytest.mark.parametrize("committed", [
    [*PROMPT, 6],  # not on the first level
    [*PROMPT, 5, 7],  # 7 is a grandchild, not a child, of 5
    [*PROMPT, 5, 6, 7],  # matched to a leaf: nothing below it
    [*PROMPT, 10],
])
def test_a_draft_off_the_committed_path_contributes_nothing(committed):
    assert reroot(TREE, len(PROMPT), committed) is None


def test_q_follows_its_nodes_and_the_anchor_becomes_the_root():
    q = (NodeQ(-1, (5, 10), (0.6, 0.4)), NodeQ(0, (6, 8), (0.5, 0.5)), NodeQ(1, (7,), (1.0,)))
    got = reroot(TREE, len(PROMPT), [*PROMPT, 5], q)
    assert got.proposal.q == (NodeQ(-1, (6, 8), (0.5, 0.5)), NodeQ(0, (7,), (1.0,)))


def test_a_base_past_the_committed_text_is_a_bug():
    with pytest.raises(ValueError, match="past the committed"):
        reroot(TREE, 5, PROMPT)
