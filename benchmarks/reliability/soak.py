"""The soak: N concurrent clients for M minutes over a link with random outages, each client
exiting mid-answer now and then, more clients than the server's session limit. Reports the
server's memory and file descriptors after warm-up and at the end, the sessions left once the
idle timeout has passed, and how every generation ended."""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from benchmarks.reliability import chat, generate, log, prompt_items, server_metrics
from edge_client.link import LinkError, ServerUnreachable
from netsim import PROFILES, NetworkConditions, ProxyThread


async def soak_client(address: str, items: list[str], deadline: float, rng: random.Random,
                      outcomes: Counter) -> None:
    while time.monotonic() < deadline:
        task = asyncio.create_task(generate(address, chat(rng.choice(items),
                                                          rng.randint(16, 48))))
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


def rss_and_fds(port: int) -> tuple[float, int]:
    sample = server_metrics(port)
    return sample["process_resident_memory_bytes"] / 2**20, int(sample["process_open_fds"])


def run_soak(address: str, metrics_port: int, clients: int, minutes: float, profile: str,
             idle_timeout_s: float) -> list[list[object]]:
    items = [row["prompt"] for row in prompt_items(40)]
    conditions = NetworkConditions.symmetric(PROFILES[profile], outage_rate_per_min=2,
                                             outage_duration_s=2.0, seed=7)
    outcomes: Counter = Counter()
    warm = {}

    async def soak() -> None:
        deadline = time.monotonic() + 60 * minutes
        tasks = [asyncio.create_task(soak_client(proxy.address, items, deadline,
                                                 random.Random(i), outcomes))
                 for i in range(clients)]
        await asyncio.sleep(min(60.0, 60 * minutes / 4))
        warm["rss"], warm["fds"] = rss_and_fds(metrics_port)
        log(f"soak warm: {warm}")
        await asyncio.gather(*tasks)

    with ProxyThread(address, conditions) as proxy:
        asyncio.run(soak())
    time.sleep(idle_timeout_s + 3)  # the orphans' idle timeout, and the reaper's round
    end_rss, end_fds = rss_and_fds(metrics_port)
    left = server_metrics(metrics_port)["splitdec_sessions_open"]
    return [["server RSS after warm-up / at the end (MB)", f"{warm['rss']:.0f} / {end_rss:.0f}"
             f" ({100 * (end_rss / warm['rss'] - 1):+.1f}%)"],
            ["server file descriptors after warm-up / at the end",
             f"{warm['fds']} / {end_fds}"],
            ["sessions left after the idle timeout", f"{left:.0f}"],
            *[[f"generations: {k}", v] for k, v in sorted(outcomes.items())]]
