"""DraftTree's whole-tree computations (shared/tree.py: depths and the ancestor mask from one
pass of bit sets, cached per tree) equal the node-by-node definitions on random trees, and so do
walk, subtree_nodes and validate (issue 63)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidRequest
from shared.tree import ROOT, DraftTree


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 140, vocab: int = 6) -> DraftTree:
    """Topological trees of up to `max_nodes` nodes, bushy or deep, siblings possibly
    repeating a token (what validate rejects)."""
    n = draw(st.integers(0, max_nodes))
    deep = draw(st.booleans())
    parents = [draw(st.integers(max(ROOT, i - 2) if deep else ROOT, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return DraftTree(tuple(tokens), tuple(parents))


def depths_by_node(tree: DraftTree) -> np.ndarray:
    depth = np.zeros(len(tree), dtype=np.int64)
    for i, parent in enumerate(tree.parents):
        depth[i] = 0 if parent == ROOT else depth[parent] + 1
    return depth


def mask_by_node(tree: DraftTree) -> np.ndarray:
    mask = np.zeros((len(tree), len(tree)), dtype=bool)
    for i, parent in enumerate(tree.parents):
        if parent != ROOT:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def subtree_by_mask(tree: DraftTree, node: int) -> tuple[DraftTree, tuple[int, ...]]:
    """subtree_nodes from the node-by-node ancestor mask: the node's descendants in order, each
    a child of its parent there (ROOT's: the whole tree)."""
    mask = mask_by_node(tree)
    nodes = tuple(i for i in range(len(tree)) if node == ROOT or (i != node and mask[i, node]))
    parents = tuple(ROOT if tree.parents[i] == node else nodes.index(tree.parents[i])
                    for i in nodes)
    return DraftTree(tuple(tree.tokens[i] for i in nodes), parents), nodes


@settings(max_examples=300, deadline=None)
@given(trees())
def test_depths_and_mask_equal_the_node_by_node_definition(tree: DraftTree):
    assert tree.depths().tolist() == depths_by_node(tree).tolist()
    assert tree.depths().dtype == np.int64 and tree.ancestor_mask().dtype == bool
    assert np.array_equal(tree.ancestor_mask(), mask_by_node(tree))
    assert tree.ancestor_mask().shape == (len(tree), len(tree))


@settings(max_examples=200, deadline=None)
@given(trees(), st.data())
def test_walk_and_subtree_equal_the_node_by_node_definition(tree: DraftTree, data: st.DataObject):
    tokens = data.draw(st.lists(st.integers(0, 5), max_size=8))
    child: dict = {}
    for i, key in enumerate(zip(tree.parents, tree.tokens)):
        child.setdefault(key, i)  # a repeated sibling: the first, as the drafter ranked it
    path, node = [], ROOT
    for token in tokens:
        if (node, token) not in child:
            break
        path.append(node := child[(node, token)])
    assert tree.walk(tokens) == path
    assert all(tree.child(parent, token) == child.get((parent, token))
               for parent in range(ROOT, len(tree)) for token in range(6))
    node = data.draw(st.integers(ROOT, len(tree) - 1))
    assert tree.subtree_nodes(node) == subtree_by_mask(tree, node)


@settings(max_examples=200, deadline=None)
@given(trees(max_nodes=40), st.integers(1, 7))
def test_validate_raises_what_the_node_by_node_checks_raise(tree: DraftTree, vocab: int):
    expected = None
    if not tree.tokens:
        expected = "draft tree is empty"
    else:
        bad = [i for i, t in enumerate(tree.tokens) if not 0 <= t < vocab]
        seen: set = set()
        repeats = [i for i, key in enumerate(zip(tree.parents, tree.tokens))
                   if key in seen or seen.add(key)]
        if bad:
            expected = f"token id {tree.tokens[bad[0]]} at node {bad[0]} is outside"
        elif repeats:
            expected = f"node {repeats[0]} repeats token"
        elif depths_by_node(tree).max() + 1 > 5:
            expected = "deep, the limit is 5"
    if expected is None:
        tree.validate(vocab, max_nodes=200, max_depth=5)
    else:
        with pytest.raises(InvalidRequest, match=expected):
            tree.validate(vocab, max_nodes=200, max_depth=5)


def test_the_cached_arrays_are_read_only():
    tree = DraftTree.chain([3, 4, 5])
    with pytest.raises(ValueError):
        tree.depths()[0] = 7
    with pytest.raises(ValueError):
        tree.ancestor_mask()[0, 1] = True
