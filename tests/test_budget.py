"""The tree budget follows the measured costs and the measured acceptance."""
from __future__ import annotations

from shared.drafting.budget import Load, TreeBudget

CPU_COSTS = [(1, 33.0), (8, 37.0), (16, 43.0), (32, 57.0), (64, 90.0)]


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
