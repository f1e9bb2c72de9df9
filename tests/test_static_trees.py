"""Static draft trees designed for the drafter (edge_client/drafters/static_trees.py, Falcon's
Custom-Designed Decoding Tree): the design from measured ranks, the tree built from a shape, the
tiny Falcon drafter drafting its designed tree with split decoding still plain greedy, and the
design travelling from the server's drafter directory to the edge in the bundle."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from cloud_server.config import ServerConfig
from cloud_server.reference import plain_greedy
from edge_client.drafter_source import designed_tree
from edge_client.drafters import static_trees, tree_drafter
from edge_client.drafters.draft_trees import Candidates
from edge_client.drafters.falcon import FalconDrafter
from edge_client.drafters.moa_bundle import find_bundle, load_manifest
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.tree_search import TreeSearch
from edge_client.link import LinkError
from shared.drafter_bundle import Precision
from shared.drafting.base import DrafterName
from shared.messages import Limits
from testkit.split_checks import assert_split_greedy_is_plain
from tests.in_process import split_greedy
from tests.server_harness import ServerThread
from testkit.tiny_falcon import PROMPT, falcon_parts

HITS = np.array([[0.6, 0.2, 0.1], [0.7, 0.1, 0.0], [0.5, 0.3, 0.0]])


def test_the_design_keeps_the_paths_of_most_expected_acceptance():
    choices = static_trees.design(HITS, 5)
    # expected acceptance: (0,) .6, (0, 0) .42, (0, 0, 0) .21, (1,) .2, (1, 0) .14; then
    # (0, 0, 1) .126 is left out
    assert choices == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert all(c[:-1] in choices or len(c) == 1 for c in choices)  # prefix-closed
    assert len(static_trees.design(HITS, 100)) < 100  # no path a rank never hit extends


def test_hits_count_a_rank_among_the_walks_that_reached_its_depth():
    walks = [[0, 0, 1], [0, 2], [1, -1], [-1]]
    hits = static_trees.rank_hits(walks, depth=3, top_k=3)
    assert hits[0].tolist() == [0.5, 0.25, 0.0]  # a miss counts in the walks that got there
    assert hits[1].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3])
    assert hits[2].tolist() == [0.0, 1.0, 0.0]


def test_a_static_tree_has_the_shape_of_its_first_choices():
    """Each node's children come from its own row (a toy: token t's children are 10t, 10t + 1
    and 10t + 2, by rank), a level at a time; only nodes with children are expanded."""
    expanded: list[list[int]] = []

    def row(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return np.log(np.array([0.5, 0.3, 0.2])), np.array(tokens)

    def expand(nodes: Candidates, frontier: list[int]):
        expanded.append(frontier)
        rows = [row([nodes.tokens[n] * 10 + r for r in range(3)]) for n in frontier]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    choices = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2))
    tree = static_trees.static_tree(row([1, 2, 3]), expand, choices, max_nodes=5)
    assert tree.tokens == (1, 2, 10, 11, 20) and tree.parents == (-1, -1, 0, 0, 1)
    assert expanded == [[0, 1]]  # (0, 0, 2) is past the budget: no third level


def test_falcon_drafts_its_designed_tree_and_stays_lossless(tiny_target, tiny_falcon_dir,
                                                            tiny_falcon_bundle, tmp_path):
    """Walked along its own greedy chain, the drafter ranks each token first; the designed
    tree is drafted with the shape designed, and split decoding with it is plain greedy."""
    _, server, acts = falcon_parts(tiny_target, tiny_falcon_dir)
    chain = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32),
                          TreeSearch(max_depth=6, beam=1, branch=1))
    chain.reset(PROMPT)
    chain.add_activations(0, acts.numpy())
    context = PROMPT + [30]
    greedy = chain.propose(context, max_nodes=6).tokens
    assert chain.ranks_along(context, greedy) == [0] * 6
    assert chain.ranks_along(context, (-5,)) == [-1]  # not among the top-k: the walk ends

    hits = static_trees.rank_hits([[0, 0, 1, 0], [0, 1], [1, 0]], depth=6, top_k=chain.graphs.top_k)
    choices = static_trees.design(hits, 8)
    static_trees.save(tmp_path, choices, hits, walks=3)
    assert static_trees.load(tmp_path) == choices
    drafter = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32),
                            TreeSearch(max_depth=6, choices=static_trees.load(tmp_path)))
    drafter.reset(PROMPT)
    drafter.add_activations(0, acts.numpy())
    tree = drafter.propose(context, max_nodes=8)
    assert sorted(tree.depths()) == sorted(len(c) - 1 for c in choices)
    assert tree.tokens[0] == greedy[0]
    tokens, per_round = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=8)
    assert tokens == plain_greedy(tiny_target, PROMPT, len(tokens))
    assert max(per_round) > 1


def test_a_tree_is_designed_from_walks_down_the_targets_text(tiny_target, tiny_falcon_dir,
                                                            tiny_falcon_bundle):
    """What benchmarks/tree_design.py does on the real model: walks gathered while the drafter
    decodes in process (the activations reach it through the walker), a design from them."""
    _, server, _ = falcon_parts(tiny_target, tiny_falcon_dir)
    drafter = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32), TreeSearch(max_depth=6))
    answer = plain_greedy(tiny_target, PROMPT, 24)
    walker = static_trees.RankWalker(drafter, [*PROMPT, *answer])
    tokens, per_round = split_greedy(tiny_target, server, walker, PROMPT, 24, max_nodes=8)
    assert tokens == answer and len(walker.walks) == len(per_round)
    hits = static_trees.rank_hits(walker.walks, depth=6, top_k=drafter.graphs.top_k)
    assert hits[0].any() and static_trees.design(hits, 8)


def test_a_drafter_directory_without_a_design_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="design one first"):
        static_trees.load(tmp_path)


def test_a_served_design_travels_in_the_bundle_and_is_drafted(tiny_target, tiny_falcon_dir,
                                                              tmp_path, monkeypatch):
    """A drafter directory holding a design (benchmarks/tree_design.py wrote it) is served
    with the design in its bundle; the edge caches it, and with tree='designed' every round's
    model tree has that shape, the text staying plain greedy's."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path / "cache"))
    drafter_dir = shutil.copytree(tiny_falcon_dir, tmp_path / "falcon")
    choices = static_trees.design(HITS, 5)
    static_trees.save(drafter_dir, choices, HITS, walks=4)
    shapes = []  # the shape each round's model tree was given

    def recorded(first, expand, shape, max_nodes):
        shapes.append(shape)
        return static_trees.static_tree(first, expand, shape, max_nodes)
    monkeypatch.setattr(tree_drafter, "static_tree", recorded)
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=drafter_dir)) as server:
        assert_split_greedy_is_plain(tiny_target, server.address, "falcon", 16,
                                     [PROMPT, [1, 60, 61, 62]], 32, expect_accepted=False,
                                     tree="designed")
    assert shapes and set(shapes) == {choices}
    bundle = find_bundle(next((tmp_path / "cache" / "drafters").iterdir()))
    assert load_manifest(bundle).designed_tree and static_trees.load(bundle) == choices


def test_a_bundle_without_a_design_is_refused_in_one_line(tiny_falcon_bundle):
    assert not load_manifest(tiny_falcon_bundle).designed_tree
    with pytest.raises(LinkError, match="without a designed tree: use --tree dynamic"):
        designed_tree(DrafterName.FALCON, tiny_falcon_bundle)
