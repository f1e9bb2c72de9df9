"""The tree budget follows the measured costs and the measured acceptance."""
from __future__ import annotations

import numpy as np
import pytest

from shared.drafting.budget import CostLine, Load, TreeBudget

CPU_COSTS = [(1, 33.0), (8, 37.0), (16, 43.0), (32, 57.0), (64, 90.0)]
GPU_COSTS = [(1, 2.0), (64, 2.0)]  # a captured graph's forward: the same for any tree


def trained(budget: TreeBudget, accepted_ranks: int, rounds: int = 200, round_ms: float = 40.0,
            verify_ms: float = 39.0) -> TreeBudget:
    """Feeds rounds in which the first `accepted_ranks` nodes are always accepted, no other."""
    for _ in range(rounds):
        budget.observe(budget.max_nodes, tuple(range(accepted_ranks)), round_ms, verify_ms)
    return budget


def test_fixed_budget_is_kept_within_the_server_limit():
    assert TreeBudget(CPU_COSTS, 64, fixed=16).nodes() == 16
    assert TreeBudget(CPU_COSTS, 64, fixed=500).nodes() == 64


def test_budget_covers_what_gets_accepted_and_no_more():
    assert trained(TreeBudget(CPU_COSTS, 64), accepted_ranks=6).nodes() == 6
    assert trained(TreeBudget(CPU_COSTS, 64), accepted_ranks=0).nodes() == 1


def test_slow_link_buys_bigger_trees():
    """When a round trip dominates, a node that is rarely accepted still pays for itself."""
    def budget_for(round_ms: float) -> int:
        b = TreeBudget(CPU_COSTS, 64)
        for i in range(300):  # rank r accepted in 1 of every 2 + 2r rounds: falling rates
            b.observe(64, tuple(r for r in range(64) if i % (2 + 2 * r) == 0), round_ms, 39.0)
        return b.nodes()
    assert budget_for(round_ms=300.0) > budget_for(round_ms=40.0)


def test_trees_shrink_when_they_share_a_forward_with_other_sessions():
    """Batched, a node costs every session in the forward its time: it must be worth the whole
    forward's tokens per ms, not just its own tree's."""
    b = TreeBudget(CPU_COSTS, 64)
    for i in range(300):  # falling acceptance rates, as in a real drafter's trees
        b.observe(64, tuple(r for r in range(64) if i % (2 + 2 * r) == 0), 39.0, 39.0)
    alone = b.nodes()
    assert b.nodes(Load(sessions=1, tokens=1 + alone)) == alone  # alone in its forward
    crowded = [b.nodes(Load(sessions=s, tokens=s * (1 + alone))) for s in (2, 8)]
    assert alone > crowded[0] > crowded[1] >= 1


def test_drafting_cost_is_a_line_fitted_to_the_rounds_sizes_and_times():
    line = CostLine()
    assert line(np.array([10]))[0] == 0.0  # nothing measured: drafting costs nothing
    for i in range(300):
        n = 1 + (7 * i) % 64  # sizes that vary, as a budget's choices do
        line.observe(n, 2.0 + 0.1 * n)
    assert line.slope == pytest.approx(0.1, rel=0.02)
    assert line(np.array([0, 50])) == pytest.approx([2.0, 7.0], rel=0.05)


def test_drafting_cost_never_falls_with_size_and_forgets_a_slope_sizes_stopped_showing():
    falling = CostLine()
    for i in range(100):
        falling.observe(1 + i % 32, 10.0 - 0.2 * (i % 32))
    assert falling.slope == 0.0 and all(falling(np.array([1, 32])) >= 0)
    line = CostLine()
    for i in range(100):
        line.observe(1 + (7 * i) % 64, 0.1 * (1 + (7 * i) % 64))
    measured = line.slope
    for _ in range(300):  # one size only: the sizes' spread decays, and with it the slope
        line.observe(20, 2.0)
    assert measured > 0.09 and line.slope < measured / 10
    assert line(np.array([20]))[0] == pytest.approx(2.0, rel=0.05)


def test_when_verification_is_flat_the_drafting_time_sizes_the_tree():
    """On a GPU every tree costs one forward: without the drafter's time a node is worth
    sending as long as it is ever accepted; with it, only while it commits more than it costs."""
    def budget_for(draft_ms_per_node: float | None) -> int:
        b = TreeBudget(GPU_COSTS, 64)
        for i in range(300):  # falling acceptance rates by rank
            sent = b.nodes()
            accepted = tuple(r for r in range(sent) if i % (2 + 2 * r) == 0)
            draft = None if draft_ms_per_node is None else 0.2 + draft_ms_per_node * sent
            b.observe(sent, accepted, 3.0, 2.0, draft)
        return b.nodes()
    assert budget_for(None) == 64
    assert 1 < budget_for(0.05) < 64
    assert budget_for(0.2) < budget_for(0.05)


def test_untried_ranks_keep_their_prior_so_the_budget_can_grow():
    b = trained(TreeBudget(CPU_COSTS, 64), accepted_ranks=2, rounds=50)
    small = b.nodes()
    for _ in range(100):  # the drafter suddenly gets much better
        b.observe(b.nodes(), tuple(range(b.nodes())), 40.0, 39.0)
    assert b.nodes() > small


def test_without_reported_costs_the_budget_still_works():
    assert 1 <= trained(TreeBudget((), 32), accepted_ranks=4).nodes() <= 32


def test_server_cost_curve_is_measured_and_monotone(tiny_target):
    from cloud_server.calibrate import measure_verify_costs, tree_sizes

    assert tree_sizes(16) == [*range(1, 9), 16] and tree_sizes(12) == [*range(1, 9), 12]
    assert tree_sizes(64) == [*range(1, 9), 16, 32, 64] and tree_sizes(5) == [1, 2, 3, 4, 5]
    costs = measure_verify_costs(tiny_target, 12, repeat=1)
    assert [n for n, _ in costs] == tree_sizes(12)
    ms = [c for _, c in costs]
    assert all(0 < a <= b for a, b in zip(ms, ms[1:]))
