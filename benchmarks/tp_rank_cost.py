"""What a rank costs a forward: the static engine over 2 ranks (gloo, the CPU) against one
process, rank 0's time split into the message to rank 1, its all-reduces (the wait for rank 1
included) and the rest, its shard's math.

SmolLM2-135M's 9 heads and 3 KV heads do not split in two, so the target is a random-weight
Llama of its width, depth, MLP and vocabulary with 8 heads of 72 and 2 KV heads (about its
FLOPs; a forward's time does not depend on the weights, and an all-reduce's bytes depend only on
the width and tokens). Each forward kind runs over 256 cached positions (a prompt chunk from
none), its cache length set back after it; one process and the 2 ranks are timed in turn, at
one thread a process (`--tensor-parallel`'s share of this machine's 2 cores). Then the same
all-reduces alone, back to back between two processes doing nothing else: the transport
without the wait for a rank still at its math. Median of `--repeat`.

`--engine transformers` times the transformers engine split by transformers' own plan
(cloud_server/engine/modules_parallel.py) the same way, against one process's transformers
engine: its collectives run inside the plan's DTensor layers, so rank 0's time is split only
into the message and the rest.

    python -m benchmarks.tp_rank_cost [--repeat 15] [--engine static] [--name tp_rank_cost]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed import TCPStore
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table
from cloud_server import model_store
from cloud_server.calibrate import bushy_tree
from cloud_server.engine.ranks import COLLECTIVE_S, LOOPBACK, join, rank_store, use_loopback
from cloud_server.target import TargetModel
from shared.messages import Limits
from shared.tree import DraftTree
from testkit.tiny_model import sharpen

CACHED = 256
LIMITS = Limits(max_tree_nodes=64, max_prompt_tokens=512, max_new_tokens=64, max_sessions=10)
# forward kind -> (sessions, tree nodes after the pending token; None: a 256-token prompt chunk)
KINDS: dict[str, tuple[int, int | None]] = {
    "decoding step": (1, 0), "tree of 16": (1, 16), "tree of 64": (1, 64),
    "8 sessions x tree of 16": (8, 16), "prompt chunk of 256": (1, None)}
COLUMNS = ("one process", "2 ranks: rank 0", "rank 0: shard math", "rank 0: message",
           "rank 0: all-reduces", "the all-reduces alone")
PLAN_COLUMNS = ("one process", "2 ranks: rank 0", "rank 0: message",
                "rank 0: its part and the collectives")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--name", default="tp_rank_cost")
    p.add_argument("--engine", choices=("static", "transformers"), default="static")
    p.add_argument("--peer", type=int, help=argparse.SUPPRESS)  # the all-reduces' other rank
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def two_way_target(out: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads and 2 KV heads, random weights, fp32."""
    path, _ = model_store.resolve("default")
    config = AutoConfig.from_pretrained(path, num_attention_heads=8, num_key_value_heads=2,
                                        head_dim=72)
    torch.manual_seed(0)
    sharpen(AutoModelForCausalLM.from_config(config, dtype=torch.float32)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(path) / name).is_file():
            (out / name).write_bytes((Path(path) / name).read_bytes())
    return out


class Stopwatch:
    """Seconds spent inside the wrapped calls since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed

    def take(self) -> tuple[float, int]:
        seen, self.seconds, calls, self.calls = self.seconds, 0.0, self.calls, 0
        return seen, calls


def forward(target: TargetModel, caches: list[Any], nodes: int | None) -> Callable[[], None]:
    """One forward of this kind over `caches`, their lengths set back after it."""
    rng = np.random.default_rng(1)

    def run() -> None:
        if nodes is None:
            cache = caches[0]
            _set_back(cache, 0)
            target.drive(target.prefill_jobs(cache, rng.integers(100, 40000, 256).tolist()))
        else:
            tree = bushy_tree(nodes) if nodes else DraftTree.chain([])
            target.run([target.tree_job(cache, 7, tree) for cache in caches])
        for cache in caches:
            _set_back(cache)
    return run


def _set_back(cache: Any, length: int = CACHED) -> None:
    """The cache back to its first `length` positions: a KV slot's length, or a DynamicCache
    cropped."""
    if hasattr(cache, "length"):
        cache.length = length
    elif cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())


def prefilled(target: TargetModel, sessions: int) -> list[Any]:
    rng = np.random.default_rng(0)
    caches = [target.new_cache() for _ in range(sessions)]
    for cache in caches:
        target.drive(target.prefill_jobs(cache, rng.integers(100, 40000, CACHED).tolist()))
    return caches


@torch.inference_mode()
def measure(one: TargetModel, split: TargetModel, repeat: int
            ) -> dict[str, dict[str, float]]:
    """forward kind -> column -> ms (median)."""
    engine = split.engine
    width = one.model.config.hidden_size
    sent, reduced = Stopwatch(), Stopwatch()
    engine.ranks.send = sent.wrap(engine.ranks.send)
    net = engine.local.net
    engine.local.net = dataclasses.replace(net, reduce=reduced.wrap(net.reduce))
    out = {}
    for kind, (sessions, nodes) in KINDS.items():
        runs = {"one": forward(one, prefilled(one, sessions), nodes),
                "split": forward(split, prefilled(split, sessions), nodes)}
        times: dict[str, list[float]] = {column: [] for column in COLUMNS[:5]}
        for _ in range(repeat):
            times[COLUMNS[0]].append(seconds(runs["one"]))
            sent.take(), reduced.take()
            total = seconds(runs["split"])
            message, (in_reduce, calls) = sent.take()[0], reduced.take()
            times[COLUMNS[1]].append(total)
            times[COLUMNS[2]].append(total - message - in_reduce)
            times[COLUMNS[3]].append(message)
            times[COLUMNS[4]].append(in_reduce)
        out[kind] = {column: 1000 * statistics.median(v) for column, v in times.items()}
        out[kind]["all-reduces"] = calls
        out[kind]["floats"] = sessions * (256 if nodes is None else 1 + nodes) * width
        print(f"{kind}: " + ", ".join(f"{c} {out[kind][c]:.1f} ms" for c in COLUMNS[:5]),
              file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def measure_plan(one: TargetModel, split: TargetModel, repeat: int
                 ) -> dict[str, dict[str, float]]:
    """The transformers engine's split: forward kind -> column -> ms (median)."""
    sent = Stopwatch()
    split.engine.ranks.send = sent.wrap(split.engine.ranks.send)
    out = {}
    for kind, (sessions, nodes) in KINDS.items():
        runs = [forward(t, prefilled(t, sessions), nodes) for t in (one, split)]
        times: dict[str, list[float]] = {column: [] for column in PLAN_COLUMNS}
        for _ in range(repeat):
            times[PLAN_COLUMNS[0]].append(seconds(runs[0]))
            sent.take()
            total = seconds(runs[1])
            message = sent.take()[0]
            times[PLAN_COLUMNS[1]].append(total)
            times[PLAN_COLUMNS[2]].append(message)
            times[PLAN_COLUMNS[3]].append(total - message)
        out[kind] = {column: 1000 * statistics.median(v) for column, v in times.items()}
        print(f"{kind}: " + ", ".join(f"{c} {out[kind][c]:.1f} ms" for c in PLAN_COLUMNS),
              file=sys.stderr, flush=True)
    return out


def report_plan(results: dict[str, dict[str, float]], repeat: int, layers: int) -> str:
    rows = [[kind, *(f"{r[c]:.1f}" for c in PLAN_COLUMNS),
             f"{r[PLAN_COLUMNS[1]] / r[PLAN_COLUMNS[0]]:.2f}"] for kind, r in results.items()]
    return (f"# The transformers engine split by its plan over 2 ranks (gloo, the CPU)\n\n"
            f"{machine()}; one thread a process; median of {repeat} runs; {2 * layers} "
            "all-reduces a forward (o and down of each layer), the logits gathered once.\n\n"
            + markdown_table(["forward", *(f"{c} ms" for c in PLAN_COLUMNS),
                              "rank 0 / one process"], rows) + "\n")


def all_reduces_alone(results: dict[str, dict[str, float]], repeat: int) -> None:
    """Adds each kind's all-reduces run back to back by two processes that do nothing else
    (a gloo group of their own, as the ranks'): what the transport costs without the wait
    for a rank still at its math."""
    sizes = [int(r["floats"]) for r in results.values()]
    calls = int(next(iter(results.values()))["all-reduces"])
    use_loopback()
    store = TCPStore(LOOPBACK, 0, 2, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-m", "benchmarks.tp_rank_cost", "--peer",
                             str(store.port), "--repeat", str(repeat), "--sizes",
                             ",".join(map(str, sizes)), "--calls", str(calls)])
    group = join(store, 0, 2, "gloo", COLLECTIVE_S)
    for r, floats in zip(results.values(), sizes):
        r[COLUMNS[5]] = 1000 * statistics.median(all_reduce_runs(group, floats, calls, repeat))
    assert peer.wait(COLLECTIVE_S) == 0


def all_reduce_runs(group: Any, floats: int, calls: int, repeat: int) -> list[float]:
    """Seconds for `calls` all-reduces of `floats` fp32 values, `repeat` times."""
    x = torch.ones(floats)
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            group.allreduce([x]).wait()
        out.append(time.perf_counter() - start)
    return out


def serve_peer(port: int, sizes: list[int], calls: int, repeat: int) -> int:
    use_loopback()
    group = join(rank_store(port), 1, 2, "gloo", COLLECTIVE_S)
    for floats in sizes:
        all_reduce_runs(group, floats, calls, repeat)
    return 0


def seconds(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def report(results: dict[str, dict[str, float]], repeat: int) -> str:
    rows = []
    for kind, r in results.items():
        beyond = r[COLUMNS[1]] - r[COLUMNS[0]] / 2
        each = 4 * r["floats"]
        rows.append([kind, f"{int(r['all-reduces'])} x {each / 1024:.1f} KiB = "
                           f"{r['all-reduces'] * each / 2**20:.2f} MiB",
                     *(f"{r[c]:.1f}" for c in COLUMNS), f"{beyond:+.1f}"])
    return (f"# {__doc__.splitlines()[0]}\n\n{machine()}; one thread a process; median of "
            f"{repeat} runs.\n\n"
            + markdown_table(["forward", "all-reduces x fp32 bytes (a forward)",
                              *(f"{c} ms" for c in COLUMNS),
                              "rank 0 beyond half of one process ms"], rows) + "\n")


def main() -> int:
    args = parse_args()
    if args.peer is not None:
        return serve_peer(args.peer, [int(n) for n in args.sizes.split(",")], args.calls,
                          args.repeat)
    torch.set_num_threads(1)
    plan = args.engine == "transformers"
    columns: tuple[str, ...]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(two_way_target(Path(tmp)))
        load = dict(precision="fp32", weights="fp32", engine=args.engine, limits=LIMITS)
        one = TargetModel.load(path, "two-way", "cpu", **load)
        split = TargetModel.load(path, "two-way", "cpu", ranks=2, **load)
        results = (measure_plan if plan else measure)(one, split, args.repeat)
        split.engine.ranks.stop()
    if plan:
        text, columns = report_plan(results, args.repeat,
                                    one.model.config.num_hidden_layers), PLAN_COLUMNS
    else:
        all_reduces_alone(results, args.repeat)
        text, columns = report(results, args.repeat), COLUMNS
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    kinds = list(results)
    grouped_bars(RESULTS / f"{args.name}.png", kinds,
                 {c: [results[k][c] for k in kinds] for c in columns}, "ms a forward",
                 f"A forward on one process and over 2 ranks ({args.engine} engine, gloo, CPU)")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
