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
wall time per token, committed tokens/s, and how busy each side's core was (CPU seconds
and seconds waiting for a core, a second of the cell's wall time: the server's process, and
this one's, the clients). Writes a table, a JSON of raw records and a stacked bar plot. Linux
only.

`--paced-ms MS` serves, in place of --engines, the GPU-paced stand-in (testkit/paced_target.py
in benchmarks/paced_server.py: the product's server around an engine that costs the host
nothing and holds MS ms a forward, as a GPU replaying captured graphs), and the split clients
draft with the rule oracle, right at the shipped MoA drafter's acceptance per depth (LOG
moa_tau_gpu) at no cost, so one core drives many sessions. Each row then also says the
committed tokens/s as a share of the ideal: sessions x tokens per session-forward / MS.
`--profile` samples the server with py-spy in each cell (benchmarks/host_profile.py) and adds
its Python time per forward pass by component; the sampler runs on the clients' core, so
those cells' timings are not to be compared with a run without it.

    python -m benchmarks.host_overhead --sessions 1,4,16 --max-new-tokens 64 \
        --engines transformers,static
    python -m benchmarks.host_overhead --paced-ms 1.5 --sessions 1,16,64 \
        --methods plain-api,server-spec,split-lockstep,split-auto --name host_paced
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from benchmarks import host_profile
from benchmarks.common import (free_port, RESULTS, add_placement_args, cloud_server,
                               grouped_bars, machine, markdown_table, module_server,
                               parse_cores, placement, stacked_bars, write_results)
from benchmarks.latency import SPLIT_PACES, method_clients, run_method
from benchmarks.reliability import server_metrics
from benchmarks.server_cpu import PARTS, SETTLE_S, server_pid, thread_times
from edge_client.client import EdgeClient
from edge_client.drafter_source import DrafterPool
from shared import prompt_sets as prompts
from shared.cache import cache_root
from shared.messages import ChatMessage, OpenRequest
from testkit.processes import children

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
PACED = "paced"  # the engine label of the GPU-paced stand-in
PACED_MODULE = "benchmarks.paced_server"
FRONTEND_MODULE = "cloud_server.rpc.frontend"


@dataclass
class Reading:
    """The server's own counters, and by part (PARTS) its threads' CPU seconds and seconds
    spent runnable but waiting for a core, at one moment; its front-end processes' (all
    their threads) apart."""

    metrics: dict[str, float]
    cpu: dict[str, float]
    wait: dict[str, float]
    frontends_cpu: float = 0.0
    frontends_wait: float = 0.0


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
    p.add_argument("--paced-ms", type=float, default=0.0, metavar="MS",
                   help="serve the GPU-paced stand-in, each forward holding MS ms, in place of "
                        "--engines; split clients draft with the rule oracle")
    p.add_argument("--frontends", default="0", metavar="N,...",
                   help="comma-separated cloud-server --frontends values, each served in turn: "
                        "gRPC in that many processes of its own (0: in the server's)")
    p.add_argument("--frontend-cores", default="1",
                   help="run the front-end processes on these cores only ('': anywhere)")
    p.add_argument("--profile", action="store_true",
                   help="sample the server with py-spy in each cell: its Python time per "
                        "forward pass by component")
    p.add_argument("--name", default="host_overhead", help="output file stem")
    add_placement_args(p)
    p.set_defaults(server_cores="0", client_cores="1")  # '' for either: anywhere
    args = p.parse_args(argv)
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.methods = args.methods.split(",")
    args.engines = [PACED] if args.paced_ms else args.engines.split(",")
    args.frontends = [int(n) for n in args.frontends.split(",")]
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
    return Reading(metrics, *thread_times(pid), *frontend_times(pid))


def read_after(pid: int, metrics_port: int) -> Reading:
    """Threads first, then metrics: the scrape's own CPU falls outside the cell."""
    cpu, wait = thread_times(pid)
    return Reading(server_metrics(metrics_port), cpu, wait, *frontend_times(pid))


def frontend_times(pid: int) -> tuple[float, float]:
    """The server's front-end processes' CPU seconds and seconds waiting for a core, so far."""
    times = [thread_times(child) for child in children(pid, FRONTEND_MODULE)]
    return (sum(sum(cpu.values()) for cpu, _ in times),
            sum(sum(wait.values()) for _, wait in times))


def delta(after: Reading, before: Reading, key: str) -> float:
    return after.metrics.get(key, 0.0) - before.metrics.get(key, 0.0)


def client_times() -> tuple[float, float]:
    """This process's (the clients') CPU seconds and seconds waiting for a core, so far."""
    cpu, wait = thread_times(os.getpid())
    return sum(cpu.values()), sum(wait.values())


async def run_cell(client: EdgeClient, method: str, batch: list[OpenRequest], pid: int,
                   metrics_port: int, profile: bool) -> dict:
    """`len(batch)` generations of `method` at once; the server's counters and CPU around,
    and the clients' CPU; with `profile`, the server's samples by component."""
    before = read_before(pid, metrics_port)
    client_before = client_times()
    sampler: contextlib.AbstractContextManager[Counter] = (
        host_profile.sampled(pid) if profile else contextlib.nullcontext(Counter()))
    with sampler as samples:
        start = time.perf_counter()
        done = await asyncio.gather(*(run_method(client, method, r) for r in batch))
        wall_s = time.perf_counter() - start
        await asyncio.sleep(SETTLE_S)  # the sessions' closing messages are the cell's too
    after = read_after(pid, metrics_port)
    client_cpu, client_wait = (b - a for a, b in zip(client_before, client_times()))
    return {"method": method, "sessions": len(batch), "wall_s": wall_s,
            "session_forwards": delta(after, before, "splitdec_forwards_total"),
            "model_forwards": delta(after, before, "splitdec_model_forwards_total"),
            "forward_ms_sum": delta(after, before, "splitdec_forward_ms_sum"),
            "tokens": delta(after, before, "splitdec_tokens_generated_total"),
            "forwarded": delta(after, before, "splitdec_batch_tokens_sum"),
            "cpu_s": {part: after.cpu[part] - before.cpu[part] for part in PARTS},
            "wait_s": {part: after.wait[part] - before.wait[part] for part in PARTS},
            "client_cpu_s": client_cpu, "client_wait_s": client_wait,
            "frontends_cpu_s": after.frontends_cpu - before.frontends_cpu,
            "frontends_wait_s": after.frontends_wait - before.frontends_wait,
            "samples": dict(samples), "generations": list(done)}


def summarize(cell: dict) -> dict:
    """A cell's milliseconds per session-forward by part, and its rates."""
    fwd = cell["session_forwards"]
    model_call = cell["forward_ms_sum"] / fwd
    cpu_ms = {part: 1000 * s / fwd for part, s in cell["cpu_s"].items()}
    # The model call is wall time: what the model thread was preempted for falls inside it,
    # so the thread's time is its CPU time plus its waits for a core; the paced stand-in's
    # hold is in it too, and on no core.
    waited = 1000 * cell["wait_s"][PARTS[0]] / fwd
    held = cell["paced_ms"] * cell["model_forwards"] / fwd
    gens = cell["generations"]
    row = {"engine": cell["engine"], "method": cell["method"], "sessions": cell["sessions"],
           "paced ms": cell["paced_ms"],
           "model call": model_call,
           "model call per pass": cell["forward_ms_sum"] / cell["model_forwards"],
           "sessions per pass": fwd / cell["model_forwards"],
           "other model thread": cpu_ms[PARTS[0]] + waited - (model_call - held),
           "model thread waited": waited,
           "event loop": cpu_ms[PARTS[1]], "gRPC and other threads": cpu_ms[PARTS[2]],
           "front ends": 1000 * cell.get("frontends_cpu_s", 0.0) / fwd,
           "tokens per forward": cell["tokens"] / fwd,
           "forwarded per forward": cell.get("forwarded", 0.0) / fwd,
           "client ms/token": 1000 * sum(g["wall_s"] / len(g["output_ids"]) for g in gens)
           / len(gens),
           "cell ms/token": 1000 * cell["wall_s"] / sum(len(g["output_ids"]) for g in gens)}
    row["wire"] = row["event loop"] + row["gRPC and other threads"]
    row["outside model call"] = row["other model thread"] + row["wire"]
    row["total"] = row["model call"] + row["outside model call"]
    wall = cell["wall_s"]
    row["tokens/s"] = cell["tokens"] / wall
    row["server busy"] = sum(cell["cpu_s"].values()) / wall
    row["server waited"] = sum(cell["wait_s"].values()) / wall
    row["clients busy"] = cell["client_cpu_s"] / wall
    row["clients waited"] = cell["client_wait_s"] / wall
    row["front ends busy"] = cell.get("frontends_cpu_s", 0.0) / wall
    row["front ends waited"] = cell.get("frontends_wait_s", 0.0) / wall
    if cell["paced_ms"]:  # every session in every forward, each forward its hold alone
        row["ideal tokens/s"] = (cell["sessions"] * row["tokens per forward"]
                                 / (cell["paced_ms"] / 1000))
        row["share of ideal"] = row["tokens/s"] / row["ideal tokens/s"]
    row["profile ms/pass"] = {part: 1000 * n / host_profile.RATE / cell["model_forwards"]
                              for part, n in cell["samples"].items()}
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
             f"{r['forwarded per forward']:.1f}",
             f"{r['client ms/token']:.1f}", f"{r['cell ms/token']:.2f}",
             f"{r['tokens/s']:.0f}",
             f"{r['share of ideal']:.2f}" if "share of ideal" in r else "-",
             f"{r['server busy']:.2f} ({r['server waited']:.2f})",
             f"{r['front ends']:.2f}",
             f"{r['front ends busy']:.2f} ({r['front ends waited']:.2f})",
             f"{r['clients busy']:.2f} ({r['clients waited']:.2f})") for r in rows]
    return markdown_table(("engine", "method", "sessions", "model call ms/session-fwd",
                           f"model call vs {rows[0]['engine']}",
                           "model call ms/pass (sessions/pass)", "other model-thread ms",
                           "wire ms (event loop + gRPC)", "host ms outside model call",
                           "total ms/session-fwd", f"total vs {BASELINE}",
                           "model thread waited for a core ms", "tokens/session-fwd",
                           "forwarded tokens/session-fwd (tree + 1)",
                           "client wall ms/token (per session)",
                           "cell wall ms/token (all sessions)", "committed tokens/s",
                           "share of ideal", "server CPU s/s (waited for a core)",
                           "front ends' CPU ms/session-fwd",
                           "front ends' CPU s/s (waited for a core)",
                           "clients CPU s/s (waited for a core)"), body)


def render_profile(rows: list[dict]) -> str:
    """The sampled server's Python time per forward pass (ms) by component, a column a cell."""
    cells = [r for r in rows if r["profile ms/pass"]]
    parts = [name for name, _ in host_profile.COMPONENTS] + [host_profile.OTHER]
    body = [(part, *(f"{r['profile ms/pass'].get(part, 0.0):.3f}" for r in cells))
            for part in parts]
    body.append(("all sampled", *(f"{sum(r['profile ms/pass'].values()):.3f}" for r in cells)))
    return markdown_table(("server Python ms per forward pass", *(
        f"{r['method']} x{r['sessions']} ({r['sessions per pass']:.1f} sessions/pass)"
        for r in cells)), body)


def differing(cells: list[dict]) -> int:
    """Answers that differ from the baseline method's to the same request (greedy: none)."""
    base = {(c["engine"], c["sessions"]): c["generations"] for c in cells
            if c["method"] == BASELINE}
    return sum(g["output_ids"] != b["output_ids"] for c in cells
               for g, b in zip(c["generations"], base[c["engine"], c["sessions"]]))


def plot(rows: list[dict], path: Path) -> None:
    """Sampled: the server's Python by component; paced: the share of the ideal; else the
    server's time per session-forward by part."""
    labels = [f"{r['engine']}\n{r['method']}\n{r['sessions']} sess." for r in rows]
    if any(r["profile ms/pass"] for r in rows):
        parts = [name for name, _ in host_profile.COMPONENTS] + [host_profile.OTHER]
        stacked_bars(path, labels, {part: [r["profile ms/pass"].get(part, 0.0) for r in rows]
                                    for part in parts},
                     "server ms per forward pass, GIL held",
                     "The server's Python by component (py-spy --gil)")
    elif "share of ideal" in rows[0]:
        sessions = sorted({r["sessions"] for r in rows})
        engines = dict.fromkeys(r["engine"] for r in rows)
        name = (lambda r: r["method"]) if len(engines) == 1 else (  # noqa: E731
            lambda r: f"{r['method']} ({r['engine']})")
        grouped_bars(path, [f"{n} sessions" for n in sessions],
                     {series: [r["share of ideal"] for n in sessions for r in rows
                               if name(r) == series and r["sessions"] == n]
                      for series in dict.fromkeys(map(name, rows))},
                     "committed tokens/s / ideal",
                     f"GPU-paced stand-in ({rows[0]['paced ms']:g} ms a forward): share of "
                     "the ideal", baseline=1.0)
    else:
        stacked_bars(path, labels, {part: [r[part] for r in rows] for part in STACK},
                     "server ms per session-forward",
                     "Host time per session-forward, stand-in target (negligible math)")


def rule_oracles(model: Path, max_new_tokens: int) -> DrafterPool:
    """A fresh rule oracle for each split generation, right at the MoA drafter's measured
    acceptance per depth (testkit/profile_oracle.py)."""
    from testkit.paced_target import RuleOracle, rule_for
    from testkit.profile_oracle import load_profile

    rule, profile = rule_for(model), load_profile()
    return DrafterPool(lambda: RuleOracle(rule, profile, max_new_tokens))


@contextlib.contextmanager
def served(engine: str, frontends: int, model: Path, metrics_port: int,
           args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """A server of the stand-in by `engine` (PACED: the GPU-paced one), on the server's
    cores, its `frontends` front-end processes on theirs; yields its address and process
    id."""
    shared = ("--model", str(model), "--metrics-port", str(metrics_port),
              "--max-sessions", str(max(args.sessions) + 4), "--frontends", str(frontends))
    cores = parse_cores(args.server_cores)
    if engine == PACED:
        server = module_server(PACED_MODULE, *shared, "--paced-ms", str(args.paced_ms),
                               cores=cores)
    else:
        server = cloud_server(*shared, "--weights", "fp32", "--device", args.device,
                              "--engine", engine, "--drafter-dir", "none", "--quiet",
                              cores=cores)
    with server as address:
        pid = server_pid(PACED_MODULE if engine == PACED else "cloud_server.cli")
        if frontend_cores := parse_cores(args.frontend_cores):
            for child in children(pid, FRONTEND_MODULE):
                os.sched_setaffinity(child, frontend_cores)
        yield address, pid


def frontends_placement(args: argparse.Namespace) -> str:
    if not any(args.frontends):
        return ""
    return f"; front-end processes on cores {args.frontend_cores or 'any'}"


def label(engine: str, frontends: int) -> str:
    return engine if not frontends else f"{engine}, {frontends} front end" + (
        "s" if frontends > 1 else "")


async def run_all(address: str, pid: int, metrics_port: int, engine: str, name: str,
                  model: Path, args: argparse.Namespace) -> list[dict]:
    """Every (sessions, method) cell, each method through a client of its own, warmed once."""
    batches = {n: requests(n, args.max_new_tokens) for n in args.sessions}
    warm = prompts.load(prompts.SETS[0], 1)[0]["prompt"]
    lent = rule_oracles(model, args.max_new_tokens) if engine == PACED else None
    cells = []
    async with method_clients(address, args.methods, args.drafter, args.max_new_tokens,
                              warm, lent) as clients:
        for n in args.sessions:
            for method in args.methods:
                cell = await run_cell(clients[method], method, batches[n], pid, metrics_port,
                                      args.profile)
                cell["engine"], cell["paced_ms"] = name, args.paced_ms
                cells.append(cell)
                row = summarize(cell)
                share = (f", {row['share of ideal']:.2f} of the ideal"
                         if "share of ideal" in row else "")
                log(f"  {name:>12} {method:>14} x{n:<3} {row['total']:6.2f} ms/session-forward "
                    f"({row['model call']:.2f} model call), {row['tokens per forward']:.2f} "
                    f"tokens/session-forward{share}")
    return cells


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = standin_dir()
    if client_cores := parse_cores(args.client_cores):
        os.sched_setaffinity(0, client_cores)  # this process: the clients
    cells = []
    for engine in args.engines:
        for frontends in args.frontends:
            metrics_port = free_port()
            with served(engine, frontends, model, metrics_port, args) as (address, pid):
                cells += asyncio.run(run_all(address, pid, metrics_port, engine,
                                             label(engine, frontends), model, args))
    rows = with_ratios([summarize(c) for c in cells])
    mismatches = differing(cells)
    served_by = (f"the GPU-paced stand-in (testkit/paced_target.py: {args.paced_ms:g} ms a "
                 f"forward, outputs by its successor rule), split drafter the rule oracle at "
                 f"moa_tau_gpu's acceptance; share of ideal: committed tokens/s over sessions "
                 f"x tokens per session-forward / {args.paced_ms:g} ms"
                 if args.paced_ms else
                 f"`--weights fp32` on {args.device}, engines {', '.join(args.engines)}, split "
                 f"drafter {args.drafter}")
    header = (f"Stand-in target: SmolLM2-135M's layout (30 layers, 9/3 heads, vocab 49152, tied) "
              f"at head_dim 8 (hidden 72, intermediate 64), random weights (seed {SEED}), "
              f"{served_by}; greedy, {args.max_new_tokens} new tokens max, answers differing "
              f"from the {BASELINE}'s: {mismatches}; loopback, no network simulation; per "
              f"session-forward (prefills included), from the server's metrics and its "
              f"per-thread CPU read from /proc around each cell (and {SETTLE_S} s after it). "
              f"Model call: wall time of the forward passes (`splitdec_forward_ms`); other "
              f"model-thread: that thread's CPU time plus its waits for a core, less the model "
              f"call (less its host part, where the paced stand-in held in it); wire: CPU time "
              f"of the event loop and gRPC's (and other) threads. "
              f"{machine()}; {placement(args)}{frontends_placement(args)}\n\n")
    profile = ("\n" + render_profile(rows) + "\n") if args.profile else ""
    write_results(args.name, header + render(rows) + "\n" + profile)
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "differing": mismatches, "cells": [
            {**c, "generations": [{k: v for k, v in g.items() if not isinstance(v, list)}
                                  for g in c["generations"]]} for c in cells],
                    "rows": rows}, indent=1))
    plot(rows, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
