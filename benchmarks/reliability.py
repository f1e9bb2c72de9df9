"""Reliability on the real model: outage storms and a soak, against one cloud-server process.

Storms: each prompt once over a clean link, then again while outages of 0.2-10 s (cut and
black-hole in turn, several per generation) hit the link: the texts must be identical, and the
table reports the time lost per outage. Soak: N concurrent clients for M minutes over a link
with random outages, each client exiting mid-answer now and then, more clients than the
server's session limit: the server's memory after warm-up and at the end, its file
descriptors, the sessions left once the idle timeout has passed, and how every generation
ended.

    python -m benchmarks.reliability --storm-prompts 6 --soak-clients 16 --soak-minutes 10
"""
from __future__ import annotations

import argparse
import asyncio
import random
import socket
import sys
import time
import urllib.request
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from shared import prompt_sets as prompts
from benchmarks.common import RESULTS, cloud_server, grouped_bars, machine, markdown_table
from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkError, ServerUnreachable
from edge_client.offline import LinkPolicy
from shared.messages import ChatMessage, OpenRequest
from netsim import PROFILES, NetworkConditions, OutageMode, ProxyThread

IDLE_TIMEOUT_S = 10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="4g")
    p.add_argument("--storm-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--max-sessions", type=int, default=12)
    p.add_argument("--name", default="reliability")
    return p.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat(prompt: str, tokens: int) -> OpenRequest:
    return OpenRequest(chat=(ChatMessage("user", prompt),), max_new_tokens=tokens)


async def generate(address: str, request: OpenRequest) -> tuple[list[int], float, int]:
    options = ClientOptions(max_new_tokens=request.max_new_tokens,
                            link_policy=LinkPolicy(reconnect_timeout_s=60))
    async with EdgeClient(address, options) as client:
        start = time.perf_counter()
        result = await client.generate(client.options.open_request(chat=request.chat))
        return result.output_ids, time.perf_counter() - start, result.reconnects


async def storm(proxy: ProxyThread, done: asyncio.Event, rng: random.Random
                ) -> tuple[int, float]:
    """Outages of 0.2-10 s, 0.5-3 s apart, until the generation is done; returns how many and
    their total length (an outage still running at the end counts up to then)."""
    count, total, loop = 0, 0.0, asyncio.get_running_loop()
    while True:
        try:
            await asyncio.wait_for(done.wait(), rng.uniform(0.5, 3.0))
            return count, total
        except asyncio.TimeoutError:
            duration = rng.uniform(0.2, 10.0) if count % 2 else rng.uniform(0.2, 2.0)
            began = loop.time()
            await asyncio.wrap_future(proxy.start_outage(duration))
            count += 1
            try:
                await asyncio.wait_for(done.wait(), duration)
                return count, total + loop.time() - began
            except asyncio.TimeoutError:
                total += duration


async def stormy(address: str, request: OpenRequest, seed: int
                 ) -> tuple[list[int], float, int, tuple[int, float]]:
    done = asyncio.Event()
    mode = OutageMode.CUT if seed % 2 else OutageMode.BLACKHOLE
    with ProxyThread(address, NetworkConditions.symmetric(PROFILES["4g"], outage_mode=mode,
                                                          seed=seed)) as proxy:
        storms = asyncio.create_task(storm(proxy, done, random.Random(seed)))
        ids, wall, reconnects = await generate(proxy.address, request)
        done.set()
        return ids, wall, reconnects, await storms


def run_storms(address: str, args: argparse.Namespace) -> list[list[object]]:
    items = [row for name in prompts.SETS
             for row in prompts.load(name, -(-args.storm_prompts // len(prompts.SETS)))]
    rows = []
    for seed, item in enumerate(items[:args.storm_prompts]):
        request = chat(item["prompt"], args.max_new_tokens)
        with ProxyThread(address, NetworkConditions.symmetric(PROFILES[args.profile])) as clean:
            ids, clean_s, _ = asyncio.run(generate(clean.address, request))
        storm_ids, storm_s, reconnects, (outages, down_s) = asyncio.run(
            stormy(address, request, seed))
        beyond = (storm_s - clean_s - down_s) / outages if outages else 0.0
        rows.append([item["id"], "cut" if seed % 2 else "blackhole", outages, f"{down_s:.1f}",
                     reconnects, f"{clean_s:.1f}", f"{storm_s:.1f}", f"{beyond:+.1f}",
                     "yes" if storm_ids == ids else "NO"])
        log(f"storm {item['id']}: {outages} outages, same text: {storm_ids == ids}")
    return rows


def server_metrics(port: int) -> dict[str, float]:
    """The server's own view of itself (`--metrics-port`): sessions, RSS, file descriptors."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return {s.name: s.value for family in text_string_to_metric_families(text.decode())
            for s in family.samples if not s.labels}


def rss_and_fds(port: int) -> tuple[float, int]:
    sample = server_metrics(port)
    return sample["process_resident_memory_bytes"] / 2**20, int(sample["process_open_fds"])


async def soak_client(address: str, items: list[str], deadline: float, rng: random.Random,
                      outcomes: Counter) -> None:
    while time.monotonic() < deadline:
        request = chat(rng.choice(items), rng.randint(16, 48))
        task = asyncio.create_task(generate(address, request))
        try:
            if rng.random() < 0.25:  # the user gives up mid-answer
                await asyncio.wait_for(asyncio.shield(task), rng.uniform(0.2, 3.0))
            else:
                await task
            outcomes["finished"] += 1
        except asyncio.TimeoutError:
            task.cancel()
            try:
                await task
                outcomes["finished"] += 1  # it ended just as the user left
            except asyncio.CancelledError:
                outcomes["client exited mid-answer"] += 1
            except LinkError as err:
                outcomes[refusal(err)] += 1
        except LinkError as err:
            outcomes[refusal(err)] += 1
            await asyncio.sleep(rng.uniform(0.5, 2.0))


def refusal(err: LinkError) -> str:
    if isinstance(err, ServerUnreachable):
        return "unreachable (gave up, or an outage when connecting)"
    return f"refused: {err.code}" if err.code else "protocol error"


def run_soak(address: str, metrics_port: int, args: argparse.Namespace) -> list[list[object]]:
    items = [row["prompt"] for name in prompts.SETS for row in prompts.load(name, 10)]
    conditions = NetworkConditions.symmetric(PROFILES[args.profile], outage_rate_per_min=2,
                                             outage_duration_s=2.0, seed=7)
    outcomes: Counter = Counter()
    warm = {}

    async def soak() -> None:
        start = time.monotonic()
        deadline = start + 60 * args.soak_minutes
        clients = [asyncio.create_task(soak_client(proxy.address, items, deadline,
                                                   random.Random(i), outcomes))
                   for i in range(args.soak_clients)]
        await asyncio.sleep(min(60.0, 60 * args.soak_minutes / 4))
        warm["rss"], warm["fds"] = rss_and_fds(metrics_port)
        log(f"soak warm: {warm}")
        await asyncio.gather(*clients)

    with ProxyThread(address, conditions) as proxy:
        asyncio.run(soak())
    time.sleep(IDLE_TIMEOUT_S + 3)  # the orphans' idle timeout, and the reaper's round
    end_rss, end_fds = rss_and_fds(metrics_port)
    left = server_metrics(metrics_port)["splitdec_sessions_open"]
    return [["server RSS after warm-up / at the end (MB)", f"{warm['rss']:.0f} / {end_rss:.0f}"
             f" ({100 * (end_rss / warm['rss'] - 1):+.1f}%)"],
            ["server file descriptors after warm-up / at the end",
             f"{warm['fds']} / {end_fds}"],
            ["sessions left after the idle timeout", f"{left:.0f}"],
            *[[f"generations: {k}", v] for k, v in sorted(outcomes.items())]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    args = parse_args()
    metrics_port = free_port()
    with cloud_server("--quiet", "--max-sessions", str(args.max_sessions), "--idle-timeout",
                      str(IDLE_TIMEOUT_S), "--metrics-port", str(metrics_port)) as address:
        storms = run_storms(address, args)
        soak = run_soak(address, metrics_port, args)
    report = (f"# Reliability ({args.profile})\n\nMachine: {machine()}; clients and server share "
              f"it.\n\n## Outage storms ({args.max_new_tokens} new tokens, outages of 0.2-10 s, "
              "0.5-3 s apart)\n\n"
              + markdown_table(["prompt", "outage mode", "outages", "s without link",
                                "reconnects", "clean s", "storm s",
                                "s lost per outage beyond its length", "same text"], storms)
              + f"\n\n## Soak ({args.soak_clients} clients, {args.soak_minutes:g} min, "
              f"--max-sessions {args.max_sessions}, random 2 s outages twice a minute, a "
              "quarter of the clients exiting mid-answer)\n\n"
              + markdown_table(["", "value"], soak) + "\n")
    (RESULTS / f"{args.name}.md").write_text(report)
    grouped_bars(RESULTS / f"{args.name}.png", [str(r[0]) for r in storms],
                 {"clean link": [float(str(r[5])) for r in storms],
                  "outage storm": [float(str(r[6])) for r in storms],
                  "time without a link": [float(str(r[3])) for r in storms]},
                 "seconds for the answer", f"Outage storms on {args.profile}: same text, "
                 "time lost (outages per prompt in the table)")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
