"""Tree forwards with the query heads grouped in torch's kernel, against repeated cache heads.

The server's attention (cloud_server/engine/gqa_attention.py) against transformers' path, which
repeats the cache's key and value heads first; on the real target, one session alone and
several in one ragged forward.

The two attention functions are swapped in one process, round by round, so the VM's drifting
speed falls on both; median of the rounds after a first that builds kernels. Every round also
checks that both give the same logits, bit for bit.

    python -m benchmarks.grouped_attention
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from benchmarks.batch_layout import sessions_with_trees
from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from cloud_server import model_store
from cloud_server.engine import ragged
from cloud_server.engine.gqa_attention import grouped
from cloud_server.target import TargetModel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1,1x4,1x8,1x16,8x1,8x4,8x8",
                   help="sessions x tree nodes, comma-separated")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads: 1, as the server pinned to one core runs")
    return p.parse_args()


def measure(target: TargetModel, sessions: int, nodes: int, repeat: int
            ) -> dict[str, float]:
    """Median ms of a forward per attention function, the sessions' jobs run as one ragged
    forward (one session: its own forward)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ways = {"repeated heads": ragged._per_session(sdpa),
            "grouped in the kernel": ragged._per_session(grouped(sdpa))}
    name = target.model.config._attn_implementation
    jobs, rewind = sessions_with_trees(target, sessions, nodes)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(repeat + 1):
        logits = []
        for way, attention in ways.items():
            AttentionInterface.register(name, attention)
            batch = jobs()
            start = time.perf_counter()
            target.run(batch)
            if r:
                times[way].append(1000 * (time.perf_counter() - start))
            logits.append(torch.cat([job.logits for job in batch]))
            rewind()
        if not torch.equal(*logits):
            raise AssertionError(f"{sessions}x{nodes}: the two attentions disagree")
    return {way: statistics.median(t) for way, t in times.items()}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    if not target.batchable or target.model.config._attn_implementation != "splitdec_ragged_sdpa":
        raise SystemExit("the target does not run sdpa attention through the ragged adapter")
    rows, groups, gains = [], [], []
    for shape in args.shapes.split(","):
        sessions, nodes = (int(n) for n in shape.split("x"))
        ms = measure(target, sessions, nodes, args.repeat)
        before, after = ms["repeated heads"], ms["grouped in the kernel"]
        rows.append([sessions, nodes, f"{before:.1f}", f"{after:.1f}", f"{before / after:.3f}x"])
        groups.append(shape)
        gains.append(before / after)
        print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
    table = markdown_table(["sessions", "tree nodes", "repeated heads ms", "grouped ms",
                            "speed-up"], rows)
    write_results("grouped_attention", f"# {__doc__.splitlines()[0]}\n\n{machine()}; the same "
                  f"logits bit for bit in every round\n\n{table}\n")
    grouped_bars(RESULTS / "grouped_attention.png", groups, {"grouped / repeated": gains},
                 "speed-up of a forward", "Tree forwards: query heads grouped in the kernel "
                 "(sessions x tree nodes)", baseline=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
