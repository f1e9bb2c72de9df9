"""Activation payloads past the message limit on the real model: a prompt at
--max-prompt-tokens, and a session rebuilt from history near --max-new-tokens. Their fp16
activations (576 x 2 bytes a row) pass the 4 MiB message cap; the Verdict goes in parts and
the edge joins them (shared/wire.py)."""
from __future__ import annotations

import asyncio

import pytest

from cloud_server.reference import plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import ServerLink
from edge_client.server_only import Mode
from shared.messages import ActivationFormat, Limits, OpenRequest, Opened, Resume, Verdict
from testkit.device_under_test import load_target
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

pytestmark = pytest.mark.slow

LIMITS = Limits()  # the server's defaults: 4096 prompt tokens, 4 MiB messages
NEW = 6


@pytest.fixture(scope="module")
def served():
    from cloud_server import model_store
    from cloud_server.moa.weights import committed_drafter

    target = load_target(*model_store.resolve("default"))
    drafter_dir = committed_drafter(target.model_id)
    if drafter_dir is None:
        pytest.skip(f"no MoA drafter committed for {target.model_id}")
    with ServerThread(target, ServerConfig(LIMITS, drafter_dir=drafter_dir)) as server:
        yield target, server


def long_prompt(target, tokens: int) -> tuple[int, ...]:
    text = " ".join(f"Item {i}: the river runs north past the mill and the old stone bridge."
                    for i in range(tokens))
    return tuple(target.tokenizer.encode(text, add_special_tokens=False)[:tokens])


def test_a_prompt_at_the_limit_sends_its_activations_in_parts(served):
    target, server = served
    prompt = long_prompt(target, LIMITS.max_prompt_tokens)
    width = server.service.info().activation_width
    assert len(prompt) * width * 2 > LIMITS.max_message_bytes

    async def generate(mode: Mode):
        async with EdgeClient(server.address, ClientOptions("moa", 8, NEW, mode=mode)) as c:
            return await c.generate(c.options.open_request(prompt_ids=prompt))
    split = asyncio.run(generate(Mode.SPLIT))
    plain = asyncio.run(generate(Mode.PLAIN_API))
    assert split.output_ids == plain.output_ids and len(split.output_ids) == NEW


def test_a_session_rebuilt_near_its_end_sends_every_row(served):
    target, server = served
    prompt = long_prompt(target, 3500)
    max_new = 64
    plain = plain_greedy(target, prompt, max_new - 1)
    history = plain[:-1]

    async def rebuild() -> tuple[Opened, Verdict, int]:
        async with ServerLink(server.address) as link:
            stream = link.decode()
            await stream.send(OpenRequest(prompt_ids=prompt, max_new_tokens=max_new,
                                          activations=ActivationFormat.FP16,
                                          resume=Resume("gone", tuple(history))))
            try:
                opened, verdict = await stream.recv(), await stream.recv()
            finally:
                stream.cancel()
            return opened, verdict, server.service.info().activation_width
    opened, verdict, width = asyncio.run(rebuild())
    rows = verdict.activations
    assert not opened.resumed and rows is not None
    assert rows.values.shape == (len(prompt) + len(history), width)
    assert rows.values.nbytes > LIMITS.max_message_bytes
    assert list(verdict.tokens) == plain[-1:]
