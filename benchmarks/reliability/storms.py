"""Outage storms: each prompt over a clean link, then again while outages of 0.2-10 s (cut and
black hole in turn, several per answer) hit the link, on each of the given profiles (lossy ones
too); several prompts run at once, each through its own proxy. The texts must be identical."""
from __future__ import annotations

import asyncio
import random
import statistics
from collections import defaultdict

from benchmarks.reliability import chat, generate, log, prompt_items
from netsim import PROFILES, NetworkConditions, OutageMode, ProxyThread
from shared.messages import OpenRequest

HEADER = ["prompt", "profile", "outage mode", "outages", "s without link", "reconnects",
          "clean s", "storm s", "s lost per outage beyond its length", "same text"]


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


async def clean_then_storm(address: str, item: dict, tokens: int, profile: str, seed: int
                           ) -> list[object]:
    """One table row: the prompt over the clean link, then through a storm."""
    request: OpenRequest = chat(item["prompt"], tokens)
    mode = OutageMode.CUT if seed % 2 else OutageMode.BLACKHOLE
    with ProxyThread(address, NetworkConditions.symmetric(PROFILES[profile],
                                                          seed=seed)) as clean:
        ids, clean_s, _ = await generate(clean.address, request)
    done = asyncio.Event()
    with ProxyThread(address, NetworkConditions.symmetric(PROFILES[profile], outage_mode=mode,
                                                          seed=seed)) as proxy:
        storms = asyncio.create_task(storm(proxy, done, random.Random(seed)))
        try:
            storm_ids, storm_s, reconnects = await generate(proxy.address, request)
        finally:
            done.set()
        outages, down_s = await storms
    beyond = (storm_s - clean_s - down_s) / outages if outages else 0.0
    log(f"storm {item['id']} on {profile}: {outages} outages, same text: {storm_ids == ids}")
    return [item["id"], profile, mode.value, outages, round(down_s, 1), reconnects,
            round(clean_s, 1), round(storm_s, 1), f"{beyond:+.1f}",
            "yes" if storm_ids == ids else "NO"]


def run_storms(address: str, prompts: int, tokens: int, profiles: list[str],
               concurrency: int) -> list[list[object]]:
    items = prompt_items(prompts)

    async def all_storms() -> list[list[object]]:
        gate = asyncio.Semaphore(concurrency)

        async def one(seed: int, item: dict) -> list[object]:
            async with gate:
                profile = profiles[(seed // 2) % len(profiles)]
                return await clean_then_storm(address, item, tokens, profile, seed)
        return await asyncio.gather(*(one(seed, item) for seed, item in enumerate(items)))
    return asyncio.run(all_storms())


def storm_summary(rows: list[list[object]]) -> list[list[object]]:
    """One row per (profile, outage mode): answers, outages, time without a link, the median
    time lost per outage beyond its length, texts identical."""
    groups: dict[tuple, list[list[object]]] = defaultdict(list)
    for row in rows:
        groups[(row[1], row[2])].append(row)
    return [[profile, mode, len(group), sum(int(r[3]) for r in group),
             round(sum(float(r[4]) for r in group)),
             f"{statistics.median(float(str(r[8])) for r in group):+.1f}",
             f"{sum(r[9] == 'yes' for r in group)}/{len(group)}"]
            for (profile, mode), group in sorted(groups.items())]


SUMMARY_HEADER = ["profile", "outage mode", "answers", "outages", "s without link",
                  "median s lost per outage beyond its length", "same text"]
