"""`edge-client serve` under concurrent load, as a user's load tool sees it.

One cloud-server, and for each endpoint mode (split, server-spec, plain-api) one
`edge-client serve` process in front of it on loopback, all running throughout. The official
`openai` async client fires streamed chat requests at an endpoint, N at once (a closed loop: a
request starts when one ends, as vLLM's load generator does with --max-concurrency), on the
evaluation prompts, each prompt at least once; at each N the modes take turns. Per mode and N:
aggregate tokens/s, time to the first token and the gaps between streamed chunks (median,
p95), errors, whether each text equals the mode's text for that prompt at N = 1 and
plain-api's, the endpoint process's memory (RSS after the runs and at its peak) and CPU time
per token, and the server's sessions per forward pass (its batching, from its Prometheus
metrics). Writes a table and two PNGs.

    python -m benchmarks.openai_load --per-set 1 --max-new-tokens 64 --concurrency 1,4,16
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import openai

from benchmarks.common import (
    RESULTS, add_placement_args, cloud_server, free_port, grouped_bars, machine, markdown_table,
    parse_cores, placement, python_module,
)
from shared import prompt_sets as prompts

MODES = ("split", "server-spec", "plain-api")
REQUEST_TIMEOUT_S = 600.0  # one request, queueing included
WARM_TOKENS = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=1, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16", help="streams at once, comma separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode at each "
                   "concurrency, the modes taking turns")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--drafter", default="auto", help="split mode's drafter (edge-client "
                   "--drafter; auto: the trained drafter the server offers)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="edge-client serve --max-concurrent (default: the endpoint's own)")
    p.add_argument("--weights", default="auto", help="cloud-server --weights")
    p.add_argument("--name", default="openai_load")
    add_placement_args(p)
    return p.parse_args()


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    prompt_id: str
    error: str | None = None
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between chunks with text


async def one_request(api: openai.AsyncOpenAI, model: str, item: dict, max_tokens: int
                      ) -> Stream:
    record = Stream(item["id"])
    start = last = time.perf_counter()
    try:
        stream = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": item["prompt"]}],
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                record.tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].delta.content:
                continue
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.gaps_s.append(now - last)
            last = now
            record.text += chunk.choices[0].delta.content
    except openai.APIError as err:
        record.error = f"{type(err).__name__}: {err}"
    return record


async def closed_loop(base_url: str, items: list[dict], concurrency: int, max_tokens: int
                      ) -> tuple[list[Stream], float]:
    """max(len(items), concurrency) requests, prompts in turn, `concurrency` at once; the
    streams and the wall time of the whole run."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                             timeout=REQUEST_TIMEOUT_S)
    model = (await api.models.list()).data[0].id
    slots = asyncio.Semaphore(concurrency)
    work = [items[i % len(items)] for i in range(max(len(items), concurrency))]

    async def limited(item: dict) -> Stream:
        async with slots:
            return await one_request(api, model, item, max_tokens)

    start = time.perf_counter()
    streams = await asyncio.gather(*(limited(item) for item in work))
    wall = time.perf_counter() - start
    await api.close()
    return list(streams), wall


@contextlib.contextmanager
def endpoint(server: str, mode: str, args: argparse.Namespace
             ) -> Iterator[tuple[str, subprocess.Popen]]:
    """`edge-client serve` in `mode` on a free port; yields its base URL and process."""
    extra = ["--drafter", args.drafter] if mode == "split" else []
    if args.max_concurrent:
        extra += ["--max-concurrent", str(args.max_concurrent)]
    proc = python_module("edge_client.cli", ["serve", "--server", server, "--port", "0",
                                             "--mode", mode, "--quiet", "--max-new-tokens",
                                             str(args.max_new_tokens), *extra],
                         parse_cores(args.client_cores), stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("serving "):
            raise RuntimeError(f"edge-client serve did not start: {line!r}")
        yield line.split()[1], proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cpu_s(pid: int) -> float:
    """The CPU time a process has used so far (user + system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident now, resident at its peak) of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def forwards(metrics_port: int) -> tuple[float, float]:
    """(session forwards, forward passes) the server has run so far."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        values = dict(line.rsplit(" ", 1) for line in reply.read().decode().splitlines()
                      if line and not line.startswith("#"))
    return (float(values["splitdec_forwards_total"]),
            float(values["splitdec_model_forwards_total"]))


def quantiles_ms(values: list[float]) -> str:
    if not values:
        return "-"
    median, p95 = np.percentile(values, [50, 95])
    return f"{1000 * median:.0f} / {1000 * p95:.0f}"


@dataclass
class Cell:
    """One mode at one concurrency, over its repeats."""

    mode: str
    concurrency: int
    streams: list[Stream] = field(default_factory=list)
    wall_s: float = 0.0
    edge_cpu_s: float = 0.0  # the endpoint process's CPU time over the runs
    session_forwards: float = 0.0
    passes: float = 0.0  # the server's forward passes (several sessions' forwards each)
    memory: tuple[float, float] = (0.0, 0.0)  # the endpoint's RSS after the last run, peak

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft_s for s in self.streams if s.ttft_s is not None]

    @property
    def errors(self) -> int:
        return sum(s.error is not None for s in self.streams)

    def exact(self, reference: dict[str, str]) -> str:
        same = sum(s.error is None and s.text == reference.get(s.prompt_id)
                   for s in self.streams)
        return f"{same}/{len(self.streams)}"

    def run(self, base_url: str, proc: subprocess.Popen, metrics_port: int, items: list[dict],
            max_tokens: int) -> None:
        before, cpu = forwards(metrics_port), cpu_s(proc.pid)
        streams, wall = asyncio.run(closed_loop(base_url, items, self.concurrency, max_tokens))
        after = forwards(metrics_port)
        self.streams += streams
        self.wall_s += wall
        self.edge_cpu_s += cpu_s(proc.pid) - cpu
        self.session_forwards += after[0] - before[0]
        self.passes += after[1] - before[1]
        self.memory = memory_mb(proc.pid)


def measure(server: str, metrics_port: int, modes: list[str], items: list[dict],
            levels: list[int], args: argparse.Namespace) -> list[Cell]:
    """Every mode's endpoint runs throughout; at each concurrency the modes take turns,
    the order rotated each repeat, so a load that comes and goes on the machine falls on
    all of them."""
    cells: list[Cell] = []
    with contextlib.ExitStack() as stack:
        running = {m: stack.enter_context(endpoint(server, m, args)) for m in modes}
        for n in levels:
            level = {m: Cell(m, n) for m in modes}
            for base_url, _ in running.values():
                # Warm: the drafters, and the server's graph for each batch size (built once)
                asyncio.run(closed_loop(base_url, items, n, WARM_TOKENS))
            for r in range(args.repeats):
                for m in modes[r % len(modes):] + modes[:r % len(modes)]:
                    level[m].run(*running[m], metrics_port, items, args.max_new_tokens)
            for cell in level.values():
                print(f"{cell.mode} x{n}: {cell.tokens_per_s:.1f} tok/s, ttft "
                      f"{quantiles_ms(cell.ttfts)} ms, {cell.errors} errors", file=sys.stderr,
                      flush=True)
            cells += level.values()
    return cells


def render(cells: list[Cell]) -> str:
    alone = {(c.mode, s.prompt_id): s.text for c in cells if c.concurrency == 1
             for s in c.streams if s.error is None}
    plain = {p: t for (m, p), t in alone.items() if m == "plain-api"}
    header = ["mode", "streams", "requests", "errors", "aggregate tok/s", "TTFT ms p50 / p95",
              "chunk gap ms p50 / p95", "same text as alone", "same text as plain-api",
              "edge RSS MB now / peak", "edge CPU ms per token", "sessions per forward"]
    rows = [[c.mode, c.concurrency, len(c.streams), c.errors,
             f"{c.tokens_per_s:.1f}", quantiles_ms(c.ttfts),
             quantiles_ms([g for s in c.streams for g in s.gaps_s]),
             c.exact({p: t for (m, p), t in alone.items() if m == c.mode}),
             c.exact(plain) if plain else "-",
             f"{c.memory[0]:.0f} / {c.memory[1]:.0f}",
             f"{1000 * c.edge_cpu_s / max(c.tokens, 1):.1f}",
             f"{c.session_forwards / max(c.passes, 1):.2f}"]
            for c in cells]
    errors = sorted({s.error for c in cells for s in c.streams if s.error})
    return markdown_table(header, rows) + "".join(f"\n\nerror: {e}" for e in errors)


def plot(cells: list[Cell], levels: list[int], modes: list[str], name: str) -> None:
    groups = [f"{n} stream{'s' if n > 1 else ''}" for n in levels]
    by = {(c.mode, c.concurrency): c for c in cells}
    grouped_bars(RESULTS / f"{name}.png", groups,
                 {m: [by[m, n].tokens_per_s for n in levels] for m in modes},
                 "aggregate tokens/s", "edge-client serve under concurrent streamed requests")
    grouped_bars(RESULTS / f"{name}_ttft.png", groups,
                 {m: [1000 * float(np.median(by[m, n].ttfts or [0])) for n in levels]
                  for m in modes},
                 "median time to first token (ms)",
                 "edge-client serve: time to first token under concurrent requests")


def main() -> int:
    args = parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    modes = args.modes.split(",")
    items = [row for name in prompts.SETS for row in prompts.load(name, args.per_set)]
    metrics_port = free_port()
    with cloud_server("--quiet", "--weights", args.weights, "--metrics-port", str(metrics_port),
                      cores=parse_cores(args.server_cores)) as server:
        cells = measure(server, metrics_port, modes, items, levels, args)
    text = (f"# edge-client serve under concurrent load\n\n{len(items)} prompts ({args.per_set} "
            f"per set), chat, greedy, {args.max_new_tokens} new tokens max, split drafter "
            f"{args.drafter}, --weights {args.weights}, endpoint --max-concurrent "
            f"{args.max_concurrent or 'default'}; {machine()}; {placement(args)}; "
            f"server and endpoints on loopback. Each row: {args.repeats} runs of max(prompts, "
            f"streams) requests, streams at once, the modes taking turns.\n\n" + render(cells) + "\n")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    plot(cells, levels, modes, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
