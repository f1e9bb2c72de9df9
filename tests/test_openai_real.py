"""`edge-client serve` on the real model, driven by the official `openai` client: the same
answer as `edge-client` for the same prompt and settings, streamed or not, and the same answers
to requests at once as to each alone."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import openai
import pytest

from testkit.cli_harness import running_endpoint, running_server

PROMPT = "Write a short poem about the sea."
FLAGS = ["--max-new-tokens", "24", "--drafter", "pld"]


@pytest.mark.slow
def test_openai_client_gets_the_cli_answer():
    with running_server() as address:
        cli = subprocess.run([sys.executable, "-m", "edge_client.cli", "--server", address,
                              *FLAGS, PROMPT], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        with running_endpoint(address, *FLAGS) as base_url:
            api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            model = api.models.list().data[0].id
            messages = [{"role": "user", "content": PROMPT}]
            whole = api.chat.completions.create(model=model, messages=messages)
            stream = api.chat.completions.create(model=model, messages=messages, stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream)
            sampled = [api.chat.completions.create(model=model, messages=messages,
                                                   temperature=0.8, seed=11, max_tokens=8)
                       for _ in range(2)]
    answer = cli.stdout.removesuffix("\n")  # the CLI ends its answer with a newline
    assert model == "SmolLM2-135M-Instruct"
    assert whole.choices[0].message.content == streamed == answer
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    stats = whole.model_extra["split_decoding"]
    # The server owns the pace: whether it asks prompt lookup for drafts here is its call
    # (cloud_server/decoding/pacing.py), so only the report's shape is asserted.
    assert stats["tau"] >= 1 and stats["pace"] == "auto"
    assert set(stats["drafts"]) == {"used", "earned", "late", "wrong"}
    assert all(s.usage.completion_tokens == 8 for s in sampled)


@pytest.mark.slow
def test_streams_at_once_get_the_answers_they_get_alone():
    """Four streamed chats at once through the default drafter (MoA: a sibling drafter state
    each over one set of ONNX sessions), their forwards batched on the server."""
    prompts = ["Write a short poem about the sea.", "What is the capital of France?",
               "List three prime numbers.", "Explain what a compiler does."]

    async def chat(api: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await api.chat.completions.create(
            model=None, messages=[{"role": "user", "content": prompt}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def scenario(base_url: str) -> tuple[list[str], list[str]]:
        api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        alone = [await chat(api, p) for p in prompts]
        return alone, list(await asyncio.gather(*(chat(api, p) for p in prompts)))

    with running_server() as address:
        with running_endpoint(address, "--max-new-tokens", "32") as base_url:
            alone, together = asyncio.run(scenario(base_url))
    assert together == alone and all(alone)
