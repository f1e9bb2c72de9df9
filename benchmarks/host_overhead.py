"""Host time per session-forward on the real server code path, with a target whose math is nil.

Why: on a GPU, SmolLM2-135M's math is well under a millisecond per forward, so what a forward
costs is host overhead: kernel launches, transformers' module dispatch, our per-node Python,
gRPC and asyncio around each forward. The same overhead shows on a CPU with a stand-in target
that has SmolLM2-135M's depth and head layout (30 layers, 9 attention heads, 3 KV heads, vocab
49152, tied embeddings) but a tiny width (head_dim 8: hidden 72, intermediate 64) and seeded
random weights, saved once under the cache directory with the real SmolLM2 tokenizer.

What: one `cloud-server --weights fp32` per engine (`--engines`: transformers' modules, the
static engine) serves the stand-in in turn, on core 0 by default, with this process's in-process clients on core 1, over loopback with no network
simulation. For each method (plain-api, server-spec, split at lock-step pace with the edge
drafter pld) and each number of sessions, that many greedy generations run at once
(asyncio.gather). Around each cell it reads the server's Prometheus metrics (session forwards,
forward passes, the `splitdec_forward_ms` histogram, tokens) and its per-thread CPU time
(/proc/PID/task/TID/schedstat), and reports per session-forward (a session's prefill, tree
verification or decoding step; several share a forward pass when batched): (a) the model call,
the `splitdec_forward_ms` sum (wall time of TargetModel.run: inputs, masks, the model, the
logits), also per forward pass; (b) the rest of the model thread (the batcher's round, the
sessions' tree and acceptance work): its CPU time plus its waits for a core, less (a), since
(a) is wall time and holds whatever preempted the thread; (c) the wire: CPU time of the event
loop and gRPC's (and the process's other) threads. Also the model thread's waits for a core
(contention: on a busy machine they inflate (a)), tokens per session-forward and the clients'
wall time per token. Writes a table, a JSON of raw records and a stacked bar plot. Linux only.

    python -m benchmarks.host_overhead --sessions 1,4,16 --max-new-tokens 64 \
        --engines transformers,static
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (free_port, RESULTS, add_placement_args, cloud_server, machine,
                               markdown_table, parse_cores, placement, stacked_bars,
                               write_results)
from benchmarks.latency import SPLIT_PACES, method_clients, run_method
from benchmarks.reliability import server_metrics
from benchmarks.server_cpu import PARTS, SETTLE_S, server_pid, thread_times
from edge_client.client import EdgeClient
from shared import prompt_sets as prompts
from shared.cache import cache_root
from shared.messages import ChatMessage, OpenRequest

METHODS = ("plain-api", "server-spec", "split-lockstep")
BASELINE = "plain-api"
STANDIN = "host-overhead-standin"
# SmolLM2-135M's depth, heads, vocabulary and special tokens; a width of 9 heads x 8.
STANDIN_SHAPE: dict[str, Any] = dict(
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
    hidden_size=72, intermediate_size=64, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
SEED = 0
# The parts of a cell's server time, per session-forward, as the plot stacks them
STACK = ("model call", "other model thread", "event loop", "gRPC and other threads")


@dataclass
class Reading:
    """The server's own counters, and by part (PARTS) its threads' CPU seconds and seconds
    spent runnable but waiting for a core, at one moment."""

    metrics: dict[str, float]
    cpu: dict[str, float]
    wait: dict[str, float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated, from: plain-api, server-spec, " + ", ".join(SPLIT_PACES)
                   + f"; {BASELINE} is the baseline of the ratio")
    p.add_argument("--drafter", default="pld", help="the split client's drafter")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the server runs the stand-in (cloud-server --device)")
    p.add_argument("--engines", default="transformers",
                   help="comma-separated cloud-server --engine values, each served in turn; "
                        "the first is the baseline of the model-call ratio")
    p.add_argument("--name", default="host_overhead", help="output file stem")
    add_placement_args(p)
    p.set_defaults(server_cores="0", client_cores="1")  # '' for either: anywhere
    args = p.parse_args(argv)
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.methods = args.methods.split(",")
    args.engines = args.engines.split(",")
    if unknown := set(args.methods) - {"plain-api", "server-spec", *SPLIT_PACES}:
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if BASELINE not in args.methods:
        p.error(f"--methods must include {BASELINE}, the baseline of the ratio")
    if min(args.sessions) < 1:
        p.error("--sessions must be 1 or more each")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def standin_dir() -> Path:
    """The stand-in checkpoint (config, random weights, SmolLM2's tokenizer), built once."""
    target = cache_root() / "models" / STANDIN
    if not (target / "config.json").is_file() or not (target / "tokenizer.json").is_file():
        build_standin(target)
    return target


def build_standin(target: Path) -> None:
    """Writes the stand-in to `target` atomically: a rename of a finished directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cloud_server.model_store import default_checkpoint

    log(f"building the stand-in target at {target} ...")
    source = default_checkpoint()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**STANDIN_SHAPE)).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{STANDIN}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def requests(count: int, max_new_tokens: int) -> list[OpenRequest]:
    """`count` chat requests, the prompt sets taken in turn (as latency.py loads them)."""
    per_set = math.ceil(count / len(prompts.SETS))
    sets = [prompts.load(name, per_set) for name in prompts.SETS]
    items = [s[i] for i in range(per_set) for s in sets if i < len(s)]
    return [OpenRequest(chat=(ChatMessage("user", item["prompt"]),),
                        max_new_tokens=max_new_tokens) for item in items[:count]]


def read_before(pid: int, metrics_port: int) -> Reading:
    """Metrics first, then the threads: the scrape's own CPU falls outside the cell."""
    metrics = server_metrics(metrics_port)
    return Reading(metrics, *thread_times(pid))


def read_after(pid: int, metrics_port: int) -> Reading:
    """Threads first, then metrics: the scrape's own CPU falls outside the cell."""
    cpu, wait = thread_times(pid)
    return Reading(server_metrics(metrics_port), cpu, wait)


def delta(after: Reading, before: Reading, key: str) -> float:
    return after.metrics.get(key, 0.0) - before.metrics.get(key, 0.0)


async def run_cell(client: EdgeClient, method: str, batch: list[OpenRequest], pid: int,
                   metrics_port: int) -> dict:
    """`len(batch)` generations of `method` at once; the server's counters and CPU around."""
    before = read_before(pid, metrics_port)
    start = time.perf_counter()
    done = await asyncio.gather(*(run_method(client, method, r) for r in batch))
    wall_s = time.perf_counter() - start
    await asyncio.sleep(SETTLE_S)  # the sessions' closing messages are the cell's too
    after = read_after(pid, metrics_port)
    return {"method": method, "sessions": len(batch), "wall_s": wall_s,
            "session_forwards": delta(after, before, "splitdec_forwards_total"),
            "model_forwards": delta(after, before, "splitdec_model_forwards_total"),
            "forward_ms_sum": delta(after, before, "splitdec_forward_ms_sum"),
            "tokens": delta(after, before, "splitdec_tokens_generated_total"),
            "cpu_s": {part: after.cpu[part] - before.cpu[part] for part in PARTS},
            "wait_s": {part: after.wait[part] - before.wait[part] for part in PARTS},
            "generations": list(done)}


def summarize(cell: dict) -> dict:
    """A cell's milliseconds per session-forward by part, and its rates."""
    fwd = cell["session_forwards"]
    model_call = cell["forward_ms_sum"] / fwd
    cpu_ms = {part: 1000 * s / fwd for part, s in cell["cpu_s"].items()}
    # The model call is wall time: what the model thread was preempted for falls inside it,
    # so the thread's time is its CPU time plus its waits for a core.
    waited = 1000 * cell["wait_s"][PARTS[0]] / fwd
    gens = cell["generations"]
    row = {"engine": cell["engine"], "method": cell["method"], "sessions": cell["sessions"],
           "model call": model_call,
           "model call per pass": cell["forward_ms_sum"] / cell["model_forwards"],
           "sessions per pass": fwd / cell["model_forwards"],
           "other model thread": cpu_ms[PARTS[0]] + waited - model_call,
           "model thread waited": waited,
           "event loop": cpu_ms[PARTS[1]], "gRPC and other threads": cpu_ms[PARTS[2]],
           "tokens per forward": cell["tokens"] / fwd,
           "client ms/token": 1000 * sum(g["wall_s"] / len(g["output_ids"]) for g in gens)
           / len(gens),
           "cell ms/token": 1000 * cell["wall_s"] / sum(len(g["output_ids"]) for g in gens)}
    row["wire"] = row["event loop"] + row["gRPC and other threads"]
    row["outside model call"] = row["other model thread"] + row["wire"]
    row["total"] = row["model call"] + row["outside model call"]
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's total per session-forward over the baseline method's on the same engine
    and sessions, and its model call over the first engine's for the same cell."""
    base = {(r["engine"], r["sessions"]): r["total"] for r in rows if r["method"] == BASELINE}
    first = rows[0]["engine"]
    call = {(r["method"], r["sessions"]): r["model call"] for r in rows if r["engine"] == first}
    return [{**r, "vs baseline": r["total"] / base[r["engine"], r["sessions"]],
             "call vs first": r["model call"] / call[r["method"], r["sessions"]]} for r in rows]


def render(rows: list[dict]) -> str:
    body = [(r["engine"], r["method"], r["sessions"], f"{r['model call']:.2f}",
             f"{r['call vs first']:.2f}",
             f"{r['model call per pass']:.2f} ({r['sessions per pass']:.1f})",
             f"{r['other model thread']:.2f}", f"{r['wire']:.2f}",
             f"{r['outside model call']:.2f}", f"{r['total']:.2f}", f"{r['vs baseline']:.2f}",
             f"{r['model thread waited']:.2f}", f"{r['tokens per forward']:.2f}",
             f"{r['client ms/token']:.1f}", f"{r['cell ms/token']:.2f}") for r in rows]
    return markdown_table(("engine", "method", "sessions", "model call ms/session-fwd",
                           f"model call vs {rows[0]['engine']}",
                           "model call ms/pass (sessions/pass)", "other model-thread ms",
                           "wire ms (event loop + gRPC)", "host ms outside model call",
                           "total ms/session-fwd", f"total vs {BASELINE}",
                           "model thread waited for a core ms", "tokens/session-fwd",
                           "client wall ms/token (per session)",
                           "cell wall ms/token (all sessions)"), body)


def plot(rows: list[dict], path: Path) -> None:
    stacked_bars(path, [f"{r['engine']}\n{r['method']}\n{r['sessions']} sess." for r in rows],
                 {part: [r[part] for r in rows] for part in STACK},
                 "server ms per session-forward",
                 "Host time per session-forward, stand-in target (negligible math)")


async def run_all(address: str, pid: int, metrics_port: int, engine: str,
                  args: argparse.Namespace) -> list[dict]:
    """Every (sessions, method) cell, each method through a client of its own, warmed once."""
    batches = {n: requests(n, args.max_new_tokens) for n in args.sessions}
    warm = prompts.load(prompts.SETS[0], 1)[0]["prompt"]
    cells = []
    async with method_clients(address, args.methods, args.drafter, args.max_new_tokens,
                              warm) as clients:
        for n in args.sessions:
            for method in args.methods:
                cell = await run_cell(clients[method], method, batches[n], pid, metrics_port)
                cell["engine"] = engine
                cells.append(cell)
                row = summarize(cell)
                log(f"  {engine:>12} {method:>14} x{n:<3} {row['total']:6.2f} ms/session-forward "
                    f"({row['model call']:.2f} model call), {row['tokens per forward']:.2f} "
                    f"tokens/session-forward")
    return cells


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = standin_dir()
    if client_cores := parse_cores(args.client_cores):
        os.sched_setaffinity(0, client_cores)  # this process: the clients
    cells = []
    for engine in args.engines:
        metrics_port = free_port()
        server_args = ("--model", str(model), "--weights", "fp32", "--device", args.device,
                       "--engine", engine, "--drafter-dir", "none",
                       "--metrics-port", str(metrics_port),
                       "--max-sessions", str(max(args.sessions) + 4), "--quiet")
        with cloud_server(*server_args, cores=parse_cores(args.server_cores)) as address:
            cells += asyncio.run(run_all(address, server_pid(), metrics_port, engine, args))
    rows = with_ratios([summarize(c) for c in cells])
    header = (f"Stand-in target: SmolLM2-135M's layout (30 layers, 9/3 heads, vocab 49152, tied) "
              f"at head_dim 8 (hidden 72, intermediate 64), random weights (seed {SEED}), "
              f"`--weights fp32` on {args.device}, engines {', '.join(args.engines)}; greedy, {args.max_new_tokens} new tokens "
              f"max, split drafter {args.drafter}, loopback, no network simulation; per "
              f"session-forward (prefills included), from the server's metrics and its "
              f"per-thread CPU read from /proc around each cell (and {SETTLE_S} s after it). "
              f"Model call: wall time of the forward passes (`splitdec_forward_ms`); other "
              f"model-thread: that thread's CPU time plus its waits for a core, less the model "
              f"call; wire: CPU time of the event loop and gRPC's (and other) threads. "
              f"{machine()}; {placement(args)}\n\n")
    write_results(args.name, header + render(rows) + "\n")
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "cells": cells, "rows": rows}, indent=1))
    plot(rows, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
