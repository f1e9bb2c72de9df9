"""Where the server's CPU goes per generated token, split decoding against the server-only modes.

On a CPU server one core runs the model and everything around it, so every millisecond the
event loop or gRPC spends on a session is taken from the forwards. For each link profile, one
prompt at a time through every method back to back, each through a client of its own
(benchmarks/latency.py), this reads the server process's per-thread CPU time
(/proc/PID/task/TID/schedstat, in ns) before and after each generation and splits it into the
model thread, the event loop (the main thread) and the rest (gRPC's threads). Reports CPU
milliseconds per generated token for each, the ratio of the total to the first method's
(server-spec by default), tokens/s, and a stacked bar plot. Linux only.

    python -m benchmarks.server_cpu --profiles 4g,3g --drafter moa --server-cores 0 --client-cores 1
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (RESULTS, add_placement_args, cloud_server, machine,
                               markdown_table, parse_cores, placement, stacked_bars,
                               write_results)
from benchmarks.latency import SPLIT_PACES, generations, run_method
from cloud_server.model_thread import MODEL_THREAD_NAME
from testkit.processes import children
from shared import prompt_sets as prompts

PARTS = ("model thread", "event loop", "gRPC and other threads")
# After a generation's last token the client still closes the session: its messages are the
# generation's cost too, so the reading waits for them.
SETTLE_S = 0.3


@dataclass
class Totals:
    """One method's generations on one link, summed."""

    tokens: int = 0
    wall_s: float = 0.0
    cpu: Counter = field(default_factory=Counter)  # seconds by part (PARTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default="4g,3g")
    p.add_argument("--drafter", default="moa", help="the split client's drafter")
    p.add_argument("--methods", default="server-spec,split-auto",
                   help="comma-separated, from: plain-api, server-spec, " + ", ".join(SPLIT_PACES)
                   + "; the first is the baseline of the ratio")
    p.add_argument("--per-set", type=int, default=3, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--name", default="server_cpu", help="output file stem")
    add_placement_args(p)
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    if unknown := set(args.methods) - {"plain-api", "server-spec", *SPLIT_PACES}:
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    return args


def server_pid(module: str = "cloud_server.cli") -> int:
    """The server process this one started: a cloud-server, or `python -m module`."""
    found = children(os.getpid(), module)
    if not found:
        raise RuntimeError(f"no {module} child process found")
    return found[0]


def thread_cpu(pid: int) -> Counter:
    """CPU seconds so far of each part of the process (PARTS)."""
    return Counter(thread_times(pid)[0])


def thread_times(pid: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds so far by part of the process (PARTS): on a CPU, and runnable but waiting for
    one (/proc/PID/task/TID/schedstat: both in ns)."""
    cpu = dict.fromkeys(PARTS, 0.0)
    wait = dict.fromkeys(PARTS, 0.0)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran, waited = (int(f) for f in (task / "schedstat").read_text().split()[:2])
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended between listing and reading
            continue
        part = (PARTS[0] if name == MODEL_THREAD_NAME
                else PARTS[1] if task.name == str(pid) else PARTS[2])
        cpu[part] += ran / 1e9
        wait[part] += waited / 1e9
    return cpu, wait


async def run_profile(address: str, pid: int, profile: str, items: list[dict],
                      args: argparse.Namespace) -> dict[str, Totals]:
    """Per method: tokens, wall seconds and CPU seconds by part, over all prompts."""
    totals = {m: Totals() for m in args.methods}
    async for method, item, client, request in generations(address, profile, items, args):
        before = thread_cpu(pid)
        done = await run_method(client, method, request)
        await asyncio.sleep(SETTLE_S)
        spent = thread_cpu(pid)
        spent.subtract(before)
        total = totals[method]
        total.tokens += len(done["output_ids"])
        total.wall_s += done["wall_s"]
        total.cpu.update(spent)
        print(f"  {profile:>9} {method:>14} {item['id']:<20} "
              f"{1000 * sum(spent.values()) / len(done['output_ids']):6.2f} server CPU ms/token",
              file=sys.stderr, flush=True)
    return totals


def rows(results: dict[str, dict[str, Totals]], baseline: str) -> list[dict]:
    out = []
    for profile, methods in results.items():
        base = methods[baseline]
        base_ms = 1000 * sum(base.cpu.values()) / base.tokens
        for method, t in methods.items():
            per_part = {part: 1000 * t.cpu[part] / t.tokens for part in PARTS}
            total = sum(per_part.values())
            out.append({"profile": profile, "method": method, **per_part, "total": total,
                        "vs_baseline": total / base_ms, "tokens_per_s": t.tokens / t.wall_s})
    return out


def render(table: list[dict], baseline: str) -> str:
    body = [(r["profile"], r["method"], f"{r['tokens_per_s']:.1f}",
             *(f"{r[part]:.2f}" for part in PARTS), f"{r['total']:.2f}",
             f"{r['vs_baseline']:.3f}") for r in table]
    return markdown_table(("link", "method", "tok/s", *(f"{p} ms/token" for p in PARTS),
                           "server CPU ms/token", f"vs {baseline}"), body)


def plot(table: list[dict], path: Path) -> None:
    stacked_bars(path, [f"{r['profile']}\n{r['method']}" for r in table],
                 {part: [r[part] for r in table] for part in PARTS},
                 "server CPU ms per generated token", "Where the server's CPU goes, by thread")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    items = [row for name in prompts.SETS for row in prompts.load(name, args.per_set)]
    results = {}
    with cloud_server("--device", "cpu", cores=parse_cores(args.server_cores)) as address:
        pid = server_pid()
        if client_cores := parse_cores(args.client_cores):
            os.sched_setaffinity(0, client_cores)
        for profile in args.profiles.split(","):
            results[profile] = asyncio.run(run_profile(address, pid, profile, items, args))
    table = rows(results, args.methods[0])
    header = (f"{len(items)} prompts ({args.per_set} per set), greedy, {args.max_new_tokens} new "
              f"tokens max, split drafter {args.drafter}; server CPU read per thread from /proc "
              f"around each generation (and {SETTLE_S} s after it); {machine()}; "
              f"{placement(args)}\n\n")
    write_results(args.name, header + render(table, args.methods[0]) + "\n")
    plot(table, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
