"""Paced split decoding under load: several edge clients on one server over a simulated link.

For 1, 2 and 4 concurrent clients (each its own prompt, from MT-Bench, HumanEval and GSM8K in
turn), split decoding at pace `auto` on a server that waits longer for client drafts while other
sessions have work queued (the default) and on one started with `--no-load-wait`, next to pace
`server` and `lockstep`. Reports aggregate tokens/s and target forwards per generated token;
the same prompts and drafter everywhere, every text checked equal across methods.

    python -m benchmarks.paced_load --drafter moa --profile 4g
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from shared import prompt_sets as prompts
from benchmarks.common import RESULTS, cloud_server, grouped_bars, machine, markdown_table
from edge_client.client import ClientOptions, EdgeClient
from edge_client.reporting import GenerationResult
from shared.messages import ChatMessage, Pace
from netsim import ProxyThread, parse_conditions

METHODS = {"auto (load wait)": (True, Pace.AUTO), "auto (no load wait)": (False, Pace.AUTO),
           "server": (True, Pace.SERVER), "lockstep": (True, Pace.LOCKSTEP)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="moa")
    p.add_argument("--profile", default="4g")
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="paced_load")
    return p.parse_args()


async def clients(address: str, options: ClientOptions, items: list[str]
                  ) -> tuple[list[GenerationResult], float]:
    async def one(prompt: str) -> GenerationResult:
        async with EdgeClient(address, options) as client:
            return await client.generate(client.options.open_request(
                chat=(ChatMessage("user", prompt),)))
    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in items))
    return list(results), time.perf_counter() - start


def main() -> int:
    args = parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    pool = [row["prompt"] for row in sum((prompts.load(s, max(counts)) for s in prompts.SETS),
                                         [])]
    items = [pool[i::max(counts)] for i in range(max(counts))]  # interleave the three sets
    flat = [p for group in items for p in group]
    conditions = parse_conditions(args.profile)
    rows, tok_s, fwd = [], {m: [] for m in METHODS}, {m: [] for m in METHODS}
    texts: dict[tuple[int, int], list[int]] = {}
    with contextlib.ExitStack() as stack:
        servers = {wait: stack.enter_context(cloud_server("--quiet", *([] if wait else
                                                                        ["--no-load-wait"])))
                   for wait in (True, False)}
        proxies = {wait: stack.enter_context(ProxyThread(address, conditions))
                   for wait, address in servers.items()}
        for n in counts:
            for method, (wait, pace) in METHODS.items():
                options = ClientOptions(args.drafter, None, args.max_new_tokens, pace=pace)
                tokens = forwards = 0
                wall = 0.0
                for r in range(args.repeats):
                    batch = flat[r * n:(r + 1) * n] if (r + 1) * n <= len(flat) else flat[:n]
                    results, seconds = asyncio.run(clients(proxies[wait].address, options,
                                                           batch))
                    wall += seconds
                    for i, result in enumerate(results):
                        same = texts.setdefault((n, r * n + i), result.output_ids)
                        assert same == result.output_ids, f"{method}: text differs"
                        tokens += len(result.output_ids)
                        forwards += result.rounds
                tok_s[method].append(tokens / wall)
                fwd[method].append(forwards / tokens)
                rows.append([n, method, f"{tokens / wall:.1f}", f"{forwards / tokens:.3f}"])
                print(f"{n} clients, {method}: {tokens / wall:.1f} tok/s, "
                      f"{forwards / tokens:.3f} forwards/token", file=sys.stderr, flush=True)
    header = ["clients", "method", "aggregate tok/s", "forwards/token"]
    report = (f"# Paced split decoding under load ({args.drafter}, {args.profile})\n\n"
              f"Machine: {machine()}; edge clients and server share it. {args.repeats} rounds "
              f"of N concurrent prompts, {args.max_new_tokens} new tokens, greedy; texts equal "
              f"across methods.\n\n" + markdown_table(header, rows) + "\n")
    (RESULTS / f"{args.name}.md").write_text(report)
    groups = [f"{n} client{'s' if n > 1 else ''}" for n in counts]
    grouped_bars(RESULTS / f"{args.name}.png", groups, fwd, "target forwards per token",
                 f"Paced split decoding under load ({args.drafter}, {args.profile}): "
                 "lower is less server work")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
