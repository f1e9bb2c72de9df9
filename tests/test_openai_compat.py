"""`edge-client serve`: request mapping, stop semantics, and the endpoint itself on the tiny model,
driven by the official `openai` client (streaming and not), errors in OpenAI's shape, and a link
that drops mid-answer."""
from __future__ import annotations

import random

import aiohttp
import openai
import pytest

from cloud_server.reference import plain_greedy
from edge_client.client import ClientOptions
from edge_client.offline import LinkPolicy, OfflinePolicy
from edge_client.openai_compat.requests import ApiError, Kind, parse_chat, parse_completion
from edge_client.openai_compat.stop_text import StopTrimmer
from netsim import LinkProfile, NetworkConditions, ProxyThread
from shared.messages import ChatMessage, Pace
from shared.sampling import SamplingParams
from testkit.openai_endpoint import serve_and, streamed
from testkit.waiting import until

DEFAULTS = ClientOptions("pld", None, 64, SamplingParams(0.0), stop_strings=("END",))
PROMPT = [5, 6, 7, 8, 5, 6, 7] * 3


def test_a_field_left_out_takes_the_serve_flag():
    api = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, DEFAULTS)
    assert api.kind is Kind.CHAT and api.chat == (ChatMessage("user", "hi"),)
    assert api.options == DEFAULTS and not api.stream and api.model is None


def test_request_fields_map_to_options():
    api = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "},
                                          {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}], "temperature": 0.7, "top_p": 0.9, "seed": 3,
        "max_completion_tokens": 9, "max_tokens": 50, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}, "top_k": 5}, DEFAULTS)
    assert api.chat[0] == ChatMessage("system", "be brief")
    assert api.options.sampling == SamplingParams(0.7, 5, 0.9, 3)
    assert api.options.max_new_tokens == 9 and api.options.stop_strings == ("x",)
    assert api.stream and api.include_usage
    text = parse_completion({"prompt": [[1, 2, 3]], "stop": ["a", "b"]}, DEFAULTS)
    assert text.kind is Kind.TEXT and text.prompt == (1, 2, 3)
    assert text.options.stop_strings == ("a", "b")


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_chat(body, DEFAULTS)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("prompt", [None, "", [], ["a", "b"], [1, "a"], [True]])
def test_bad_completion_prompts_are_refused(prompt):
    with pytest.raises(ApiError, match="prompt"):
        parse_completion({"prompt": prompt}, DEFAULTS)


@pytest.mark.parametrize("seed", range(30))
def test_streamed_stop_trimming_equals_trimming_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab\nST"
    stops = tuple("".join(rng.choices(alphabet, k=rng.randint(1, 3)))
                  for _ in range(rng.randint(0, 3)))
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    trimmer = StopTrimmer(stops)
    sent, i = "", 0
    while i < len(text):
        j = i + rng.randint(1, 4)
        sent += trimmer.push(text[i:j])
        i = j
    sent += trimmer.finish()
    cuts = [k for k in (text.find(s) for s in stops) if k >= 0]
    assert sent == text[:min(cuts, default=len(text))]


def test_completions_equal_plain_greedy_streamed_or_not(tiny_server, tiny_target):
    async def scenario(api, base, edge):
        model = (await api.models.list()).data[0].id
        whole = await api.completions.create(model=model, prompt=PROMPT, max_tokens=20)
        text, chunks = await streamed(api, model=model, prompt=PROMPT, max_tokens=20)
        return whole, text, chunks, edge.decode(plain_greedy(tiny_target, PROMPT, 20))

    whole, text, chunks, expected = serve_and(tiny_server.address, scenario)
    assert whole.choices[0].text == text == expected
    assert whole.usage.completion_tokens == 20 and whole.usage.prompt_tokens == len(PROMPT)
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    stats = whole.model_extra["split_decoding"]
    assert stats["mode"] == "split" and stats["drafter"] == "pld" and stats["rounds"] >= 1
    assert "split_decoding" in chunks[-1].model_extra


def test_stop_strings_end_the_answer_before_them(tiny_server):
    async def scenario(api, base, edge):
        full = (await api.completions.create(model=None, prompt=PROMPT, max_tokens=30)).choices[0]
        stop = full.text[10:12]
        cut = await api.completions.create(model=None, prompt=PROMPT, max_tokens=30, stop=[stop])
        text, chunks = await streamed(api, model=None, prompt=PROMPT, max_tokens=30, stop=stop)
        return full.text, stop, cut.choices[0], text, chunks

    full, stop, cut, text, chunks = serve_and(tiny_server.address, scenario)
    assert cut.text == text == full[:full.find(stop)]
    assert cut.finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_chat_streams_deltas_and_usage(tiny_server):
    async def scenario(api, base, edge):
        messages = [{"role": "user", "content": "hello"}]
        whole = await api.chat.completions.create(model=None, messages=messages, max_tokens=12)
        stream = await api.chat.completions.create(model=None, messages=messages, max_tokens=12,
                                                   stream=True,
                                                   stream_options={"include_usage": True})
        return whole, [c async for c in stream]

    whole, chunks = serve_and(tiny_server.address, scenario)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 12


def test_errors_come_in_openais_shape(tiny_server):
    async def scenario(api, base, edge):
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await api.chat.completions.create(model="gpt-4", messages=[
                {"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await api.completions.create(model=None, prompt="x", temperature=9)
        with pytest.raises(openai.BadRequestError, match="refused: invalid_argument"):
            await api.completions.create(model=None, prompt=[10**6], max_tokens=2)
        async with aiohttp.ClientSession() as http:
            replies = [await http.post(f"{base}/completions", data=b"{not json"),
                       await http.get(f"{base}/nowhere"),
                       await http.get(f"{base}/completions")]
            return [(r.status, await r.json()) for r in replies]

    (bad, bad_body), (missing, missing_body), (method, _) = serve_and(tiny_server.address,
                                                                      scenario)
    assert bad == 400 and "not JSON" in bad_body["error"]["message"]
    assert missing == 404 and set(missing_body["error"]) == {"message", "type", "param", "code"}
    assert method == 405


def test_a_dropped_link_never_streams_unverified_text(isolated_server):
    """The server is cut off mid-answer and never returns: with --offline-policy keep, the
    unverified offline text goes out only to a request that allows it; with 'draft', the
    stream ends with an error event after the committed text."""
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=40))  # ~2 s for the answer

    def options(policy: OfflinePolicy) -> ClientOptions:
        return ClientOptions("pld", 1, 48, pace=Pace.LOCKSTEP, link_policy=LinkPolicy(
            offline=policy, reconnect_timeout_s=1.0, backoff_max_s=0.3, offline_limit=24))

    def generated() -> float:
        metrics = isolated_server.service.metrics.registry
        return metrics.get_sample_value("splitdec_tokens_generated_total") or 0

    async def cut_after_first_text(api, proxy, **extra):
        before = generated()
        stream = await api.completions.create(model=None, prompt=PROMPT, max_tokens=48,
                                              stream=True, stream_options={"include_usage": True},
                                              **extra)
        chunks = [await anext(stream)]  # sent as the generation starts
        # the text comes whole at the end (the tiny model's tokens are bytes of no character)
        await until(lambda: generated() >= before + 8, 30, "some rounds done")
        proxy.start_outage(60)
        chunks += [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-2:]

    for allow in (False, True):
        with ProxyThread(isolated_server.address, slow) as proxy:
            text, (last, usage) = serve_and(
                proxy.address, lambda api, base, edge: cut_after_first_text(
                    api, proxy, extra_body={"allow_unverified": allow}),
                options(OfflinePolicy.KEEP))
        stats = last.model_extra["split_decoding"]
        assert stats["unverified_tokens"] > 0 and stats["unverified_included"] is allow, stats
        assert last.choices[0].finish_reason == "length"
        # One byte per token: the committed text has at most as many characters as tokens.
        committed = usage.usage.completion_tokens
        assert (len(text) > committed) is allow, (text, committed)
    with ProxyThread(isolated_server.address, slow) as proxy:
        with pytest.raises(openai.APIError, match="gave up"):
            serve_and(proxy.address, lambda api, base, edge: cut_after_first_text(api, proxy),
                      options(OfflinePolicy.DRAFT))
