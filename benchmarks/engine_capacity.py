"""The engine's capacity with gRPC elsewhere: the server's process alone, driven over the frames
its front ends speak, around the GPU-paced stand-in.

Why: `cloud-server --frontends N` moves gRPC into processes of its own. On a GPU node those get
cores of their own, and the engine's process is then what bounds the forwards. This 2-core
machine cannot show that with real front ends and gRPC clients: they share the second core and
saturate it (results log, `frontends_paced`). Here one driver process on the other core speaks
the engine's frames itself (cloud_server/rpc/frames.py), as a front end carrying every session
would, with no gRPC on either side, so the engine's core is the limit. The server is
benchmarks/paced_server.py --engine-socket: the product's service, batcher and sessions around
the stand-in (testkit/paced_target.py), which computes its outputs by a rule and holds the given
milliseconds a forward. Split sessions run at lock-step and draft with the rule oracle at the
MoA drafter's measured acceptance per depth, trees of `--tree-nodes` (what the gRPC clients'
budget sent in `frontends_paced`); the plain API and server-side speculation are Generate calls.

For each number of sessions and method, that many greedy generations at once. Reports the
committed tokens/s, its ratio to the plain API's, its share of the ideal (sessions x tokens per
session-forward / the hold), sessions a forward pass, the engine's CPU a session-forward (its
process, every thread) and how busy each side's core was. Every answer must equal the plain
API's. Writes a table, a JSON of the cells and a plot. Linux only.

    python -m benchmarks.engine_capacity --paced-ms 1.5 --sessions 1,16,64
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from benchmarks.common import (RESULTS, add_placement_args, free_port, grouped_bars, machine,
                               markdown_table, module_server, parse_cores, placement,
                               write_results)
from benchmarks import host_profile
from benchmarks.host_overhead import PACED_MODULE, render_profile, requests, standin_dir
from benchmarks.reliability import server_metrics
from benchmarks.server_cpu import server_pid, thread_times
from cloud_server.rpc.frames import FrameStream, Kind, opening
from cloud_server.rpc.relay import SERVICE, TAKEN
from edge_client.server_only import SERVER_DRAFTER
from shared import wire
from shared.messages import (Done, DraftRequest, FinishReason, GenerateRequest, OpenRequest, Pace,
                             ServerMessage, Verdict)
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from testkit.paced_target import RuleOracle, SuccessorRule, rule_for
from testkit.profile_oracle import load_profile

METHODS = ("plain-api", "server-spec", "split-lockstep")
BASELINE = "plain-api"
DECODE, GENERATE = (f"/{SERVICE.full_name}/{name}" for name in ("Decode", "Generate"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paced-ms", type=float, default=1.5, help="a forward's hold")
    p.add_argument("--sessions", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: "
                   + ", ".join(METHODS) + f"; {BASELINE} is the baseline")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--tree-nodes", type=int, default=126, help="a lock-step draft's nodes")
    p.add_argument("--profile", action="store_true",
                   help="sample the engine with py-spy in each cell: its Python time per "
                        "forward pass by component (benchmarks/host_profile.py)")
    p.add_argument("--name", default="engine_capacity", help="output file stem")
    add_placement_args(p)
    p.set_defaults(server_cores="0", client_cores="1")
    args = p.parse_args(argv)
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.methods = args.methods.split(",")
    if unknown := set(args.methods) - set(METHODS):
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if BASELINE not in args.methods:
        p.error(f"--methods must include {BASELINE}, the baseline")
    return args


class Call:
    """One call on the engine's link, as a front end relays it."""

    def __init__(self, link: FrameStream, call: int, queue: asyncio.Queue):
        self._link, self._id, self._queue = link, call, queue

    def send(self, message) -> None:
        self._link.send(self._id, Kind.MSG, message.SerializeToString())

    def end(self) -> None:
        self._link.send(self._id, Kind.END)

    async def next(self) -> ServerMessage | None:
        """The next message, or None when the call ends OK; RuntimeError on another status."""
        kind, payload = await self._queue.get()
        if kind is Kind.STATUS:
            status = json.loads(payload)
            if status["code"] != "OK":
                raise RuntimeError(f"{status['code']}: {status['details']}")
            return None
        return wire.server_from_proto(pb.ServerMessage.FromString(payload))


class Driver:
    """The calls of every session over one link to the engine; each message it is sent is
    acknowledged as a front end does once gRPC takes it."""

    def __init__(self, link: FrameStream):
        self._link = link
        self._calls: dict[int, asyncio.Queue] = {}

    async def run(self) -> None:
        while True:
            call, kind, payload = await self._link.read()
            if kind is Kind.MSG:
                self._link.send(call, Kind.TAKEN, TAKEN.pack(len(payload)))
            if (queue := self._calls.get(call)) is not None:
                queue.put_nowait((kind, payload))

    def open(self, method: str) -> Call:
        call = len(self._calls) + 1
        self._calls[call] = asyncio.Queue()
        self._link.send(call, Kind.OPEN, opening(method, "unix:driver", None))
        return Call(self._link, call, self._calls[call])


async def server_only(driver: Driver, request: OpenRequest, drafter: str | None) -> list[int]:
    """A Generate call to its end: the tokens of its Verdicts."""
    call = driver.open(GENERATE)
    call.send(wire.generate_to_proto(GenerateRequest(request, drafter)))
    call.end()
    tokens: list[int] = []
    while (msg := await call.next()) is not None:
        if isinstance(msg, Verdict):
            tokens.extend(msg.tokens)
    return tokens


async def lockstep(driver: Driver, request: OpenRequest, oracle: RuleOracle,
                   nodes: int) -> list[int]:
    """A lock-step Decode session: a draft of `nodes` from the oracle after each Verdict,
    Close after Done."""
    call = driver.open(DECODE)
    call.send(wire.client_to_proto(replace(request, pace=Pace.LOCKSTEP)))
    opened = await call.next()
    context = list(opened.prompt_ids)  # type: ignore[union-attr]
    oracle.reset(context)
    start, round_id = len(context), 0
    while (msg := await call.next()) is not None:
        if isinstance(msg, Verdict):
            context.extend(msg.tokens)
            if msg.finish_reason is FinishReason.NOT_FINISHED:
                round_id += 1
                call.send(wire.client_to_proto(DraftRequest(
                    round_id, len(context), oracle.propose(context, nodes))))
        elif isinstance(msg, Done):
            call.send(pb.ClientMessage(close=pb.Close()))
            call.end()
    return context[start:]


def generation(driver: Driver, method: str, request: OpenRequest, rule: SuccessorRule,
               args: argparse.Namespace):
    if method == "split-lockstep":
        oracle = RuleOracle(rule, load_profile(), args.max_new_tokens)
        return lockstep(driver, request, oracle, args.tree_nodes)
    return server_only(driver, request, SERVER_DRAFTER if method == "server-spec" else None)


def cpu(pid: int) -> tuple[float, float]:
    """A process's CPU seconds and seconds waiting for a core, so far (every thread)."""
    ran, waited = thread_times(pid)
    return sum(ran.values()), sum(waited.values())


async def run_cell(driver: Driver, method: str, batch: list[OpenRequest], rule: SuccessorRule,
                   pid: int, metrics_port: int, args: argparse.Namespace) -> dict:
    before, engine_before, driver_before = server_metrics(metrics_port), cpu(pid), cpu(os.getpid())
    sampler: contextlib.AbstractContextManager[Counter] = (
        host_profile.sampled(pid) if args.profile else contextlib.nullcontext(Counter()))
    with sampler as samples:
        start = time.perf_counter()
        answers = await asyncio.gather(*(generation(driver, method, r, rule, args)
                                         for r in batch))
        wall_s = time.perf_counter() - start
        engine_after, driver_after = cpu(pid), cpu(os.getpid())
    after = server_metrics(metrics_port)
    grew = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in (
        "splitdec_forwards_total", "splitdec_model_forwards_total",
        "splitdec_tokens_generated_total")}
    return {"method": method, "sessions": len(batch), "wall_s": wall_s,
            "session_forwards": grew["splitdec_forwards_total"],
            "forward_passes": grew["splitdec_model_forwards_total"],
            "tokens": grew["splitdec_tokens_generated_total"],
            "engine_cpu_s": engine_after[0] - engine_before[0],
            "engine_wait_s": engine_after[1] - engine_before[1],
            "driver_cpu_s": driver_after[0] - driver_before[0],
            "driver_wait_s": driver_after[1] - driver_before[1], "samples": dict(samples),
            "answers": answers}


def summarize(cell: dict, paced_ms: float) -> dict:
    sf, wall = cell["session_forwards"], cell["wall_s"]
    per_forward = cell["tokens"] / sf
    tokens_s = cell["tokens"] / wall
    return {"method": cell["method"], "sessions": cell["sessions"],
            "tokens per forward": per_forward, "sessions per pass": sf / cell["forward_passes"],
            "tokens/s": tokens_s,
            "share of ideal": tokens_s / (cell["sessions"] * per_forward / (paced_ms / 1000)),
            "engine ms/session-forward": 1000 * cell["engine_cpu_s"] / sf,
            "engine busy": cell["engine_cpu_s"] / wall, "engine waited": cell["engine_wait_s"] / wall,
            "driver busy": cell["driver_cpu_s"] / wall, "driver waited": cell["driver_wait_s"] / wall,
            "profile ms/pass": {part: 1000 * n / host_profile.RATE / cell["forward_passes"]
                                for part, n in cell["samples"].items()}}


async def run_all(path: str, pid: int, metrics_port: int, model: Path,
                  args: argparse.Namespace) -> list[dict]:
    driver = Driver(FrameStream(*await asyncio.open_unix_connection(path)))
    reader = asyncio.get_running_loop().create_task(driver.run())
    rule = rule_for(model)
    cells = []
    try:
        for method in args.methods:  # warm: each method once, a few tokens
            await generation(driver, method, requests(1, 4)[0], rule, args)
        for n in args.sessions:
            batch = requests(n, args.max_new_tokens)
            for method in args.methods:
                cells.append(await run_cell(driver, method, batch, rule, pid, metrics_port, args))
                row = summarize(cells[-1], args.paced_ms)
                print(f"  {method:>14} x{n:<3} {row['tokens/s']:7.0f} tokens/s, "
                      f"{row['share of ideal']:.2f} of the ideal, "
                      f"{row['engine ms/session-forward']:.3f} engine ms/session-forward",
                      file=sys.stderr, flush=True)
    finally:
        reader.cancel()
    return cells


def differing(cells: list[dict]) -> int:
    base = {c["sessions"]: c["answers"] for c in cells if c["method"] == BASELINE}
    return sum(a != b for c in cells for a, b in zip(c["answers"], base[c["sessions"]]))


def render(rows: list[dict]) -> str:
    base = {r["sessions"]: r["tokens/s"] for r in rows if r["method"] == BASELINE}
    body = [(r["method"], r["sessions"], f"{r['tokens per forward']:.2f}",
             f"{r['sessions per pass']:.1f}", f"{r['tokens/s']:.0f}",
             f"{r['tokens/s'] / base[r['sessions']]:.2f}x", f"{r['share of ideal']:.2f}",
             f"{r['engine ms/session-forward']:.3f}",
             f"{r['engine busy']:.2f} ({r['engine waited']:.2f})",
             f"{r['driver busy']:.2f} ({r['driver waited']:.2f})") for r in rows]
    return markdown_table(("method", "sessions", "tokens/session-fwd", "sessions/pass",
                           "committed tokens/s", f"vs {BASELINE}", "share of ideal",
                           "engine CPU ms/session-fwd", "engine CPU s/s (waited for a core)",
                           "driver CPU s/s (waited)"), body)


def plot(rows: list[dict], path: Path, paced_ms: float) -> None:
    sessions = sorted({r["sessions"] for r in rows})
    grouped_bars(path, [f"{n} sessions" for n in sessions],
                 {m: [r["share of ideal"] for n in sessions for r in rows
                      if r["method"] == m and r["sessions"] == n]
                  for m in dict.fromkeys(r["method"] for r in rows)},
                 "committed tokens/s / ideal",
                 f"The engine alone, gRPC elsewhere ({paced_ms:g} ms a forward)", baseline=1.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = standin_dir()
    if client_cores := parse_cores(args.client_cores):
        os.sched_setaffinity(0, client_cores)  # this process: the driver
    path = str(Path(tempfile.mkdtemp(prefix="engine-capacity-")) / "engine.sock")
    metrics_port = free_port()
    with module_server(PACED_MODULE, "--model", str(model), "--paced-ms", str(args.paced_ms),
                       "--metrics-port", str(metrics_port), "--max-sessions",
                       str(max(args.sessions) + 4), "--engine-socket", path,
                       cores=parse_cores(args.server_cores)):
        cells = asyncio.run(run_all(path, server_pid(PACED_MODULE), metrics_port, model, args))
    rows = [summarize(c, args.paced_ms) for c in cells]
    header = (f"The GPU-paced stand-in ({args.paced_ms:g} ms a forward) served by "
              f"benchmarks/paced_server.py --engine-socket, driven over the front ends' frames "
              f"by one process with no gRPC; split at lock-step, the rule oracle at "
              f"moa_tau_gpu's acceptance, {args.tree_nodes}-node trees; greedy, "
              f"{args.max_new_tokens} new tokens max; answers differing from the "
              f"{BASELINE}'s: {differing(cells)}. Share of ideal: committed tokens/s over "
              f"sessions x tokens per session-forward / {args.paced_ms:g} ms. Engine CPU: its "
              f"process, every thread, from /proc. {machine()}; "
              f"{placement(args).replace('clients', 'driver')}\n\n")
    profile = ("\n" + render_profile(rows) + "\n") if args.profile else ""
    write_results(args.name, header + render(rows) + "\n" + profile)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"args": vars(args), "cells": [{k: v for k, v in c.items() if k != "answers"}
                                       for c in cells], "rows": rows}, indent=1))
    plot(rows, RESULTS / f"{args.name}.png", args.paced_ms)
    return 0 if differing(cells) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
