"""`edge-client serve` answering requests at once on the tiny model: each streamed answer is
the one it gets alone, a full queue answers 429 with Retry-After, and a client that hangs up
mid-stream frees its generation and its session on the server."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from cloud_server.reference import plain_greedy
from edge_client.client import ClientOptions
from edge_client.offline import LinkPolicy
from edge_client.openai_compat.admission import Admission
from edge_client.openai_compat.requests import ApiError
from edge_client.openai_compat.serving import Capacity
from netsim import LinkProfile, NetworkConditions, ProxyThread
from shared.messages import Limits, Pace
from cloud_server.config import ServerConfig
from testkit.openai_endpoint import serve_and, streamed
from testkit.waiting import until
from tests.server_harness import ServerThread

PROMPTS = [[5 + i, 6, 7, 8, 5 + i, 6, 7, 9 + 2 * i] * 3 for i in range(6)]
MAX_NEW = 32
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64, max_sessions=16,
                session_idle_timeout_s=300)  # an orphaned session would outlive the test


@pytest.fixture(scope="module")
def moa_server(tiny_target, tiny_drafter_dir):
    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        yield server


@pytest.mark.parametrize("drafter, pace", [("pld", Pace.LOCKSTEP), ("pld", Pace.AUTO),
                                           ("moa", Pace.AUTO)])
def test_requests_at_once_each_stream_the_text_they_get_alone(moa_server, tiny_target, drafter,
                                                              pace, tmp_path, monkeypatch):
    """Six streams through three slots (three queued): the server batches their forwards and
    each MoA generation drafts with a sibling over the one set of ONNX sessions."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    options = ClientOptions(drafter, None, MAX_NEW, pace=pace)

    async def scenario(api, base, edge):
        alone = [(await streamed(api, model=None, prompt=p, max_tokens=MAX_NEW))[0]
                 for p in PROMPTS]
        together = await asyncio.gather(*(streamed(api, model=None, prompt=p,
                                                   max_tokens=MAX_NEW) for p in PROMPTS))
        plain = [edge.decode(plain_greedy(tiny_target, p, MAX_NEW)) for p in PROMPTS]
        return alone, [text for text, _ in together], plain

    alone, together, plain = serve_and(moa_server.address, scenario, options,
                                       Capacity(max_concurrent=3))
    assert together == alone == plain


def test_a_request_past_the_queue_is_refused_with_retry_after(moa_server):
    """One slot, no queue: a second request while the first streams is refused at once; once
    the first is done, the next is answered."""
    async def scenario(api, base, edge):
        first = await api.completions.create(model=None, prompt=PROMPTS[0], max_tokens=MAX_NEW,
                                             stream=True)
        await anext(first)  # the first chunk: it holds the slot
        with pytest.raises(openai.RateLimitError) as refused:
            await api.completions.create(model=None, prompt=PROMPTS[1], max_tokens=4)
        rest = [c async for c in first]
        after = await api.completions.create(model=None, prompt=PROMPTS[1], max_tokens=4)
        return refused.value, rest, after

    refused, rest, after = serve_and(moa_server.address, scenario,
                                     capacity=Capacity(max_concurrent=1, max_queue=0))
    assert int(refused.response.headers["Retry-After"]) >= 1
    assert refused.body["code"] == "queue_full" and "--max-queue 0" in refused.message
    assert rest[-1].choices[0].finish_reason == "length"
    assert after.usage.completion_tokens == 4


def test_the_queue_admits_in_turn_and_forgets_a_caller_that_left():
    async def go():
        admission = Admission(max_concurrent=1, max_queue=1)
        order: list[str] = []
        release = asyncio.Event()

        async def request(name: str) -> None:
            async with admission.turn():
                order.append(name)
                await release.wait()

        first = asyncio.create_task(request("first"))
        second = asyncio.create_task(request("second"))
        await asyncio.sleep(0)
        assert (admission.running, admission.waiting) == (1, 1)
        with pytest.raises(ApiError) as full:
            async with admission.turn():
                pass
        second.cancel()  # its client hung up while it waited
        await asyncio.gather(second, return_exceptions=True)
        third = asyncio.create_task(request("third"))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, third)
        return full.value, order, admission

    full, order, admission = asyncio.run(go())
    assert full.status == 429 and full.headers["Retry-After"] == "1"
    assert order == ["first", "third"]
    assert (admission.running, admission.waiting) == (0, 0)


@pytest.mark.parametrize("pace", [Pace.LOCKSTEP, Pace.SERVER])
def test_a_client_that_hangs_up_frees_its_generation_and_server_session(tiny_target, pace):
    """Over a slow link the answer takes seconds; the client closes the stream while the
    server's session runs. The endpoint closes the session (an abandoned one would be held for
    a resume, here for 300 s), and its one slot takes the next request."""
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=40))
    options = ClientOptions("pld", 1, 48, pace=pace, lead=2,
                            link_policy=LinkPolicy(reconnect_timeout_s=5.0))

    async def scenario(server, api):
        stream = await api.completions.create(model=None, prompt=PROMPTS[0], max_tokens=48,
                                              stream=True)
        await until(lambda: len(server.service.sessions) == 1, 20, "the server's session")
        await stream.response.aclose()
        await until(lambda: len(server.service.sessions) == 0, 20,
                    "the hung-up generation's session closed")
        return await until_admitted(api)

    with ServerThread(tiny_target, ServerConfig(LIMITS)) as server:
        with ProxyThread(server.address, slow) as proxy:
            after = serve_and(proxy.address, lambda api, base, edge: scenario(server, api),
                              options, Capacity(max_concurrent=1, max_queue=0))
    assert after.usage.completion_tokens == 2


async def until_admitted(api: openai.AsyncOpenAI, timeout_s: float = 20.0):
    """A short request, repeated while the endpoint answers 429 (the hung-up generation's slot
    frees just after its session), up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await api.completions.create(model=None, prompt=PROMPTS[1], max_tokens=2)
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot was never freed"
            await asyncio.sleep(0.05)
