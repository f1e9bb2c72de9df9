"""Prometheus metrics, scraped over HTTP while a generation runs on the tiny model."""
from __future__ import annotations

import asyncio

from edge_client.client import ClientOptions, EdgeClient
from edge_client.reporting import SilentListener
from edge_client.link import LinkError
from shared.messages import Pace
from testkit.waiting import scrape

PROMPT = (5, 6, 7, 8, 5, 6, 7) * 3


class ScrapeMidway(SilentListener):
    def __init__(self, port: int):
        self.port, self.seen = port, None

    def committed(self, ids: list[int]) -> None:
        if self.seen is None:
            self.seen = scrape(self.port)


def test_metrics_follow_a_generation(isolated_server):
    service = isolated_server.service
    port = service.metrics.serve("127.0.0.1", 0)
    before = scrape(port)
    listener = ScrapeMidway(port)

    async def run():
        options = ClientOptions("pld", 4, 24, pace=Pace.LOCKSTEP)
        async with EdgeClient(isolated_server.address, options) as client:
            result = await client.generate(client.options.open_request(prompt_ids=PROMPT),
                                           listener)
            try:
                await client.generate(client.options.open_request(prompt_ids=(10**6,)))
            except LinkError:
                pass
            return result
    result = asyncio.run(run())
    after = scrape(port)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert listener.seen["splitdec_sessions_open"] >= 1  # scraped during the generation
    assert grew("splitdec_tokens_generated_total") == len(result.output_ids)
    assert grew("splitdec_forwards_total") == result.rounds + 1  # the prefill is one
    assert grew("splitdec_accepted_draft_tokens_sum") == result.accepted_tokens
    assert grew("splitdec_accepted_at_depth_total[1]") >= 1
    assert grew("splitdec_sessions_opened_total[new]") == 1
    assert grew("splitdec_requests_refused_total[invalid_argument]") == 1
    assert grew("splitdec_bytes_total[out]") >= result.bytes_down - 64 * result.rounds
    assert grew("splitdec_bytes_total[in]") > 0
    assert grew("splitdec_verify_ms_count") == result.rounds + 1
    # one session alone: every forward pass carried it alone, its pending token and its tree
    assert grew("splitdec_model_forwards_total") == result.rounds + 1
    assert grew("splitdec_batch_sessions_sum") == result.rounds + 1
    assert grew("splitdec_batch_tokens_sum") >= len(PROMPT) + result.rounds
    assert grew("splitdec_forward_ms_count") == result.rounds + 1
    assert after["process_resident_memory_bytes"] > 0 and after["process_open_fds"] > 0
