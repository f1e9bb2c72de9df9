"""Reliability, from one command, against real cloud-server processes: the Decode contract fuzzed
(on the tiny model, a healthy generation beside), outage storms, server restarts mid-generation
and a soak (on the real model). `python -m benchmarks.reliability --help` lists the knobs; the
report and plot land in benchmarks/results/. The parts share what is below."""
from __future__ import annotations

import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from edge_client.client import ClientOptions, EdgeClient
from edge_client.offline import LinkPolicy
from shared import prompt_sets
from shared.messages import ChatMessage, OpenRequest


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat(prompt: str, tokens: int) -> OpenRequest:
    return OpenRequest(chat=(ChatMessage("user", prompt),), max_new_tokens=tokens)


def prompt_items(count: int) -> list[dict]:
    """`count` evaluation prompts, taken from each set in turn."""
    per_set = [prompt_sets.load(name, -(-count // len(prompt_sets.SETS)))
               for name in prompt_sets.SETS]
    return [row for rows in zip(*per_set) for row in rows][:count]


async def generate(address: str, request: OpenRequest) -> tuple[list[int], float, int]:
    """One answer through the product's client: (ids, seconds, reconnects)."""
    options = ClientOptions(max_new_tokens=request.max_new_tokens,
                            link_policy=LinkPolicy(reconnect_timeout_s=120))
    async with EdgeClient(address, options) as client:
        start = time.perf_counter()
        result = await client.generate(client.options.open_request(chat=request.chat))
        return result.output_ids, time.perf_counter() - start, result.reconnects


def server_metrics(port: int) -> dict[str, float]:
    """A server's own view of itself (`--metrics-port`), keyed `name` or `name{label=value}`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in s.labels.items()): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}
