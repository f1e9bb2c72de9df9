"""What growing the KV cache in place saves a forward, measured on the real target.

A forward appends its tokens to each session's cache. transformers' DynamicLayer does that by
concatenation, copying the whole cache; the server's ReservedLayer (cloud_server/engine/kv_cache.py)
writes them into a buffer with room. For caches of 256 to 2,048 positions, three forwards are
timed with each cache, interleaved: a decoding step (one token), a tree verification (16
nodes, compacted to an accepted path of 3 after it, as the server does), and a ragged forward
of 8 sessions' decoding steps. The logits of the two must be the same bits. Median of
`--repeat` runs; ratio = in place / concatenated. `--device cuda` times them on a GPU.

    python -m benchmarks.kv_growth [--device cuda --name kv_growth_gpu]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table
from cloud_server import model_store
from cloud_server.calibrate import bushy_tree
from cloud_server.engine.kv_cache import whole_cache
from cloud_server.engine.kv_cache import keep_path
from cloud_server.target import TargetModel
from shared.tree import DraftTree

CACHES = ("concatenated", "in place")
SESSIONS = 8
TREE = bushy_tree(16)
ACCEPTED = (0, 2, 6)  # a path in TREE


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", default="256,512,1024,2048")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the target runs (fp32)")
    p.add_argument("--name", default="kv_growth")
    return p.parse_args()


def prefilled(target: TargetModel, length: int, seed: int) -> dict[str, DynamicCache]:
    """One prompt's cache of each kind, holding the same keys and values (prefilled once)."""
    ids = np.random.default_rng(seed).integers(100, target.vocab_size, length).tolist()
    in_place = whole_cache(target.model.config, in_place=True)
    target.drive(target.prefill_jobs(in_place, ids))
    concatenated = DynamicCache(config=target.model.config)
    for i, layer in enumerate(in_place.layers):
        concatenated.update(layer.keys.clone(), layer.values.clone(), i)
    return {"concatenated": concatenated, "in place": in_place}


def forwards(target: TargetModel, caches: list[DynamicCache]) -> dict[str, Callable[[], list]]:
    """Each forward kind on these caches; each returns its logits."""
    def step() -> list:
        job = target.tree_job(caches[0], 7, DraftTree((), ()))
        target.run([job])
        return [job.logits]

    def tree() -> list:
        base = caches[0].get_seq_length()
        job = target.tree_job(caches[0], 7, TREE)
        target.run([job])
        keep_path(caches[0], base, ACCEPTED)
        return [job.logits]

    def batched() -> list:
        jobs = [target.tree_job(cache, 7, DraftTree((), ())) for cache in caches]
        target.run(jobs)
        return [job.logits for job in jobs]
    return {"decoding step": step, "tree of 16": tree, f"{SESSIONS} sessions' steps": batched}


def timed(run: Callable[[], list]) -> tuple[float, list]:
    """Seconds to the forward's end (on a GPU, its kernels' too) and what it returned."""
    start = time.perf_counter()
    out = run()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


@torch.inference_mode()
def measure(target: TargetModel, length: int, repeat: int) -> dict[str, tuple[float, float, bool]]:
    """forward kind -> (concatenated ms, in place ms, same logits)."""
    caches = [prefilled(target, length, seed) for seed in range(SESSIONS)]
    runs = {kind: forwards(target, [both[kind] for both in caches]) for kind in CACHES}
    out = {}
    for name in runs["in place"]:
        times: dict[str, list[float]] = {kind: [] for kind in CACHES}
        same = True
        for _ in range(repeat):
            results = {}
            for kind in CACHES:
                seconds, results[kind] = timed(runs[kind][name])
                times[kind].append(seconds)
            same &= all(torch.equal(a, b) for a, b in zip(*results.values()))
        out[name] = (1000 * statistics.median(times["concatenated"]),
                     1000 * statistics.median(times["in place"]), same)
    return out


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    target = TargetModel.load(*model_store.resolve("default"), args.device)
    lengths = [int(n) for n in args.positions.split(",")]
    results = {}
    for length in lengths:
        results[length] = measure(target, length, args.repeat)
        print(f"{length} positions: " + ", ".join(
            f"{name} {a:.1f} -> {b:.1f} ms" for name, (a, b, _) in results[length].items()),
            file=sys.stderr, flush=True)
    names = list(results[lengths[0]])
    rows = [[length, name, f"{a:.1f}", f"{b:.1f}", f"{b / a:.3f}", "yes" if same else "NO"]
            for length in lengths for name, (a, b, same) in results[length].items()]
    report = RESULTS / f"{args.name}.md"
    report.write_text(
        f"# {__doc__.splitlines()[0]}\n\n{machine()}, one compute thread, the target on "
        f"{args.device}; median of {args.repeat} interleaved runs.\n\n"
        + markdown_table(["cached positions", "forward", "concatenated ms", "in place ms",
                          "ratio", "same logits"], rows) + "\n")
    grouped_bars(RESULTS / f"{args.name}.png", [str(n) for n in lengths],
                 {name: [results[n][name][1] / results[n][name][0] for n in lengths]
                  for name in names},
                 "forward time, in place / concatenated",
                 "Growing the KV cache in place, by cached positions",
                 baseline=1.0)
    print(report.read_text())
    return 0 if all(same for r in results.values() for _, _, same in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
