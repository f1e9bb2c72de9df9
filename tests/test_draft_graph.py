"""Draft graphs (shared/draft_graph.py): a tree's repeated subtrees travel once and come back
exact."""
from __future__ import annotations

import numpy as np
import pytest

from shared import wire
from shared.draft_q import NodeQ
from shared.errors import InvalidRequest
from shared.draft_graph import DraftGraph, breadth_first, fold
from shared.messages import DraftRequest
from shared.tree import ROOT, DraftTree


def repeating_tree() -> DraftTree:
    """Two first tokens (1010, 1011), each continued by the same 2020 -> (2021 -> 2023, 2022)
    subtree."""
    return breadth_first(DraftTree((1010, 2020, 2021, 2022, 2023, 1011, 2020, 2021, 2022, 2023),
                                   (-1, 0, 1, 1, 2, -1, 5, 6, 6, 7)))


def random_tree(rng: np.random.Generator, n: int, vocab: int) -> DraftTree:
    """A random tree with few distinct tokens, so subtrees repeat."""
    tokens: list[int] = []
    parents: list[int] = []
    while len(tokens) < n:
        parent = int(rng.integers(-1, len(tokens)))
        token = int(rng.integers(vocab))
        if (parent, token) not in set(zip(parents, tokens)):
            tokens.append(token)
            parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def test_a_repeated_subtree_travels_once_and_unrolls_exactly():
    tree = repeating_tree()
    graph = fold(tree)
    assert len(graph.tree) == 7 and len(graph.aliases) == 1  # 1011's 2020 stands for 1010's
    node, target = graph.aliases[0]
    assert graph.tree.parents[node] == graph.tree.tokens.index(1011) and target < node
    graph.validate(max_nodes=7)
    assert graph.unrolled(64) == tree


def test_random_breadth_first_trees_round_trip():
    rng = np.random.default_rng(0)
    folded = 0
    for _ in range(300):
        tree = breadth_first(random_tree(rng, int(rng.integers(1, 40)), 3))
        graph = fold(tree)
        graph.validate(max_nodes=64)
        assert graph.unrolled(64) == tree
        folded += len(tree) - len(graph.tree)
    assert folded > 0


def test_a_tree_out_of_breadth_first_order_travels_as_it_is():
    tree = DraftTree((10, 20, 21, 11, 20, 21), (-1, 0, 1, -1, 3, 4))  # depth first
    assert fold(tree) == DraftGraph(tree)
    assert fold(tree).unrolled(64) == tree


def test_unrolling_stops_at_the_node_limit_with_a_valid_tree():
    tree = repeating_tree()
    cut = fold(tree).unrolled(5)
    assert cut == tree.prefix(5)
    cut.validate(vocab_size=4096, max_nodes=5, max_depth=8)


BAD_GRAPHS = {
    "later target": (DraftGraph(DraftTree((10, 20, 11, 20), (-1, 0, -1, 2)), ((1, 3),)),
                     "earlier node"),
    "token mismatch": (DraftGraph(DraftTree((10, 20, 11, 21), (-1, 0, -1, 2)), ((3, 1),)),
                       "token"),
    "alias with children": (DraftGraph(DraftTree((10, 20, 11, 20, 30), (-1, 0, -1, 2, 3)),
                                       ((3, 1),)), "children of its own"),
    "alias of an ancestor": (DraftGraph(DraftTree((10, 10), (-1, 0)), ((1, 0),)), "cycle"),
    # 1 -> 3 == 2 -> 4 == 1: each target is earlier than its alias, and the two loop
    "cycle through two aliases": (DraftGraph(DraftTree((10, 11, 12, 11, 10),
                                                       (-1, -1, -1, 0, 1)), ((3, 1), (4, 0))),
                                  "cycle"),
    "repeated alias": (DraftGraph(DraftTree((10, 20, 11, 20), (-1, 0, -1, 2)),
                                  ((3, 1), (3, 1))), "repeats"),
    "alias outside": (DraftGraph(DraftTree((10,), (-1,)), ((4, 0),)), "not a node"),
    "too many nodes": (DraftGraph(DraftTree(tuple(range(10, 20)), (-1,) * 10), ((9, 0),)),
                       "limit"),
}


@pytest.mark.parametrize("case", BAD_GRAPHS)
def test_bad_graphs_are_refused_with_the_reason(case):
    graph, words = BAD_GRAPHS[case]
    with pytest.raises(InvalidRequest, match=words):
        graph.validate(max_nodes=8)


def test_the_wire_carries_the_graph_and_the_server_gets_the_tree():
    tree = repeating_tree()
    draft = DraftRequest(3, 7, tree)
    assert not wire.client_to_proto(draft).draft.alias_nodes  # only to a server that unrolls
    raw = wire.client_to_proto(draft, graphs=True)
    assert len(raw.draft.tokens) == 7 and list(raw.draft.alias_nodes)
    plain = wire.draft_to_proto(draft, graphs=False)
    assert raw.draft.ByteSize() < plain.ByteSize()
    assert wire.client_from_proto(raw, 64) == draft
    assert wire.client_from_proto(raw, 7).tree == tree.prefix(7)  # cut at the limit


def test_a_tree_with_q_travels_plain_and_aliases_with_q_are_refused():
    tree = repeating_tree()
    q = (NodeQ(ROOT, (1010, 1011), (0.5, 0.5)),)
    raw = wire.client_to_proto(DraftRequest(1, 7, tree, q), graphs=True)
    assert not raw.draft.alias_nodes and wire.client_from_proto(raw, 64).tree == tree
    raw.draft.alias_nodes.append(3)
    raw.draft.alias_targets.append(1)
    with pytest.raises(InvalidRequest, match="q"):
        wire.client_from_proto(raw, 64)
    raw = wire.client_to_proto(DraftRequest(1, 7, tree), graphs=True)
    raw.draft.alias_targets.append(0)
    with pytest.raises(InvalidRequest, match="alias targets"):
        wire.client_from_proto(raw, 64)
