"""What a tensor-parallel rank holds in host memory while it builds its shard: read a slice at a
time from the checkpoint (cloud_server/engine/checkpoint_slices.py, what a rank > 0 does now)
against loading the checkpoint whole and cutting it (what it did before, and still does for a
checkpoint it cannot read by name).

Each way runs in a fresh process, rank 1 of `--ranks`, on the default target (SmolLM2-135M,
stored in fp32; 9 heads and 3 KV heads split in 3), served in fp32 as stored and in bf16: its
peak resident memory (VmHWM), and what it still holds once the shard is built, its own
(RssAnon) apart from the checkpoint's pages it has mapped (RssFile: the page cache, shared by
the ranks and given back under pressure), beside a process that only imports torch and
transformers.

    python -m benchmarks.rank_memory [--ranks 3] [--name rank_memory]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results

WAYS = ("imports only", "slices", "whole")
DTYPES = ("float32", "bfloat16")


def _memory_mb() -> dict[str, float]:
    """This process's peak and current resident memory (proc(5) status), MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024
            for key in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def child(way: str, dtype_name: str, rank: int, ranks: int) -> dict[str, float]:
    """Builds rank `rank`'s shard `way` in `dtype_name` in this process; its memory after."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from cloud_server import model_store
    from cloud_server.engine.parallel_engine import ShardJob
    from cloud_server.engine.rank_worker import skeleton
    from cloud_server.engine.static_engine import SlotPlan

    if way == "imports only":
        return _memory_mb()
    dtype = getattr(torch, dtype_name)
    path, _ = model_store.resolve(model_store.DEFAULT_SPEC)
    job = ShardJob(path, dtype, "cpu", SlotPlan(1, 64, 8), None, False)
    if way == "slices":
        model, read = skeleton(job)
    else:
        model, read = AutoModelForCausalLM.from_pretrained(path, dtype=dtype), None
    net = job.shard(model, rank, ranks, read)
    del model
    gc.collect()
    held = sum(p.numel() * p.element_size() for layer in net.layers
               for p in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight,
                         layer.down.weight)) / 2**20
    return {**_memory_mb(), "layers MB": held, "embedding MB": net.embed.numel()
            * net.embed.element_size() / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--name", default="rank_memory")
    p.add_argument("--child", nargs=2, metavar=("WAY", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], 1, args.ranks)))
        return
    results = {}
    for dtype in DTYPES:
        for way in WAYS:
            out = subprocess.run([sys.executable, "-m", "benchmarks.rank_memory", "--child",
                                  way, dtype, "--ranks", str(args.ranks)], capture_output=True,
                                 text=True, check=True).stdout
            results[dtype, way] = json.loads(out.strip().splitlines()[-1])
    rows = []
    for (dtype, way), r in results.items():
        base = results[dtype, "imports only"]
        rows.append((dtype, way, f"{r['VmHWM'] - base['VmHWM']:.0f}",
                     f"{r['RssAnon'] - base['RssAnon']:.0f}",
                     f"{r['RssFile'] - base['RssFile']:.0f}", f"{r.get('layers MB', 0):.0f}",
                     f"{r.get('embedding MB', 0):.0f}"))
    table = markdown_table((
        "served in", "rank 1 builds its shard from", "peak MB beyond imports",
        "its own memory after (RssAnon) MB", "checkpoint pages mapped after (RssFile) MB",
        "its layers' weights MB", "embedding MB"), [r for r in rows if r[1] != WAYS[0]])
    write_results(args.name, f"# A rank's host memory while it builds its shard\n\n"
                             f"{machine()}; rank 1 of {args.ranks}, SmolLM2-135M stored in "
                             f"fp32\n\n{table}\n")
    labels = [f"{dtype}: peak" for dtype in DTYPES] + [f"{dtype}: own after" for dtype in DTYPES]
    grouped_bars(RESULTS / f"{args.name}.png", labels, {way: [
        *(results[d, way]["VmHWM"] - results[d, WAYS[0]]["VmHWM"] for d in DTYPES),
        *(results[d, way]["RssAnon"] - results[d, WAYS[0]]["RssAnon"] for d in DTYPES)]
        for way in WAYS[1:]}, "MB beyond importing torch and transformers",
        f"Rank 1 of {args.ranks}: its slices read alone against the checkpoint loaded whole")


if __name__ == "__main__":
    main()
