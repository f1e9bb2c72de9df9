"""Measures what verifying a tree costs this server, so clients can size their trees.

Run once at startup on the model thread. The right tree for a fast link on a CPU server is small
(each node adds compute), the right tree for a slow link or a GPU is large (the round trip or
the kernel launch dominates); Sequoia (Chen et al. 2024, section 4) picks the tree from measured
costs the same way. docs/performance.md.
"""
from __future__ import annotations

import statistics
import time

from cloud_server.target import SLOT_TEXT_FLOOR, TargetModel
from shared import progress
from shared.tree import DraftTree

PREFIX_TOKENS = SLOT_TEXT_FLOOR  # a static engine's KV slot holds it and the largest tree
BRANCHING = 4
EACH_SIZE_UP_TO = 8


def bushy_tree(n: int, vocab: int | None = None) -> DraftTree:
    """A tree shaped like a drafter's: up to BRANCHING children per node, breadth first; its
    tokens 0.. n - 1, taken modulo `vocab` when given."""
    return DraftTree(tuple(i % vocab if vocab else i for i in range(n)),
                     tuple((i - 1) // BRANCHING if i else -1 for i in range(n)))


def tree_sizes(max_nodes: int) -> list[int]:
    """Every size up to EACH_SIZE_UP_TO, then 16, 32, ... up to max_nodes, and max_nodes
    itself. A CPU kernel's cost steps at small row counts (oneDNN's register blocking,
    cloud_server/engine/cpu_kernels.py), which interpolating between powers of two would miss."""
    sizes = [n for n in range(1, EACH_SIZE_UP_TO + 1) if n <= max_nodes]
    sizes += [1 << k for k in range(4, max_nodes.bit_length()) if 1 << k <= max_nodes]
    return sizes if sizes[-1] == max_nodes else [*sizes, max_nodes]


def measure_verify_costs(target: TargetModel, max_nodes: int, repeat: int = 3
                         ) -> tuple[tuple[int, float], ...]:
    """(nodes, ms) of one tree forward plus compaction after a PREFIX_TOKENS prefix: the median
    of `repeat` runs, made non-decreasing in nodes (a smaller tree never costs more; timing
    noise sometimes says otherwise)."""
    vocab = target.vocab_size
    prefix = [(7 * i + 11) % vocab for i in range(PREFIX_TOKENS)]
    cache, _ = target.prefill(prefix)
    sizes = tree_sizes(max_nodes)
    trees = [bushy_tree(n, vocab) for n in sizes]

    def run(tree: DraftTree) -> float:
        start = time.perf_counter()
        target.forward_tree(cache, prefix[-1], tree)
        target.keep_path(cache, PREFIX_TOKENS - 1, ())  # back to the prefix alone
        return 1000 * (time.perf_counter() - start)

    with progress.bar(2 * len(trees), "measuring verify costs", "tree size") as shown:
        for tree in trees:  # first calls per shape build kernels: keep them out of the figures
            run(tree)
            shown.update()
        medians = []
        for tree in trees:
            medians.append(statistics.median(run(tree) for _ in range(repeat)))
            shown.update()
    for i in range(len(medians) - 2, -1, -1):
        medians[i] = min(medians[i], medians[i + 1])
    return tuple(zip(sizes, medians))
