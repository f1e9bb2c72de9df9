"""The server's cost model: one verification forward over a tree of n nodes vs one plain decode
step, after the same prefix (DESIGN section 7). Tree size pays only while
tau grows faster than T_verify(n).

    python benchmarks/verify_cost.py --prefix 200
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.common import RESULTS, machine, markdown_table
from cloud_server import model_store
from cloud_server.target import TargetModel, keep_path
from shared.tree import DraftTree

SIZES = (1, 2, 4, 8, 16, 32, 64)


def time_ms(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def plain_step(target: TargetModel, cache: DynamicCache, base: int) -> None:
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True)
    cache.crop(-1)


def tree_step(target: TargetModel, cache: DynamicCache, base: int, tree: DraftTree) -> None:
    target.forward_tree(cache, 42, tree)
    keep_path(cache, base, ())


def bushy_tree(n: int) -> DraftTree:
    """A tree shaped like a drafter's: 4 children per node, breadth first."""
    return DraftTree(tuple(100 + i for i in range(n)), tuple((i - 1) // 4 if i else -1
                                                             for i in range(n)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    target = TargetModel.load(*model_store.resolve("default"), device="cpu")
    cache, _ = target.prefill(list(range(1000, 1000 + args.prefix)))
    plain = time_ms(lambda: plain_step(target, cache, args.prefix), args.repeat)
    rows = [("plain decode step", f"{plain:.1f}", "1.00")]
    for n in SIZES:
        ms = time_ms(lambda: tree_step(target, cache, args.prefix, bushy_tree(n)), args.repeat)
        rows.append((f"tree of {n}", f"{ms:.1f}", f"{ms / plain:.2f}"))
    table = markdown_table(("forward", "median ms", "vs plain step"), rows)
    text = f"prefix {args.prefix} tokens; {machine()}\n\n{table}\n"
    print(text)
    (RESULTS / "verify_cost.md").write_text(text)


if __name__ == "__main__":
    main()
