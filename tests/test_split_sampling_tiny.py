"""Sampling over split decoding, end to end on the tiny model: races are a function of
(seed, prompt) alone, seeded sessions replay, and the server refuses what it cannot honour."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from edge_client.client import ClientOptions, EdgeClient
from shared.acceptance import AcceptanceMode
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.sampling import SamplingParams
from testkit.race_decoding import race_reference
from testkit.raw_stream import assert_refused, open_msg

PROMPT = [5, 6, 7, 8, 5, 6, 7]
MAX_NEW = 30
SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)


def generate(address: str, drafter: str, nodes: int | None, sampling: SamplingParams,
             acceptance: AcceptanceMode | None):
    async def go():
        options = ClientOptions(drafter, nodes, MAX_NEW, sampling, acceptance)
        async with EdgeClient(address, options) as client:
            return await client.generate(options.open_request(prompt_ids=PROMPT))
    return asyncio.run(go())


def test_exponential_race_text_is_the_same_whatever_the_drafter(tiny_server, tiny_target):
    race = AcceptanceMode.EXPONENTIAL_RACE
    outputs = {(d, n): generate(tiny_server.address, d, n, SAMPLING, race).output_ids
               for d in ("pld", "aded") for n in (1, 8, None)}
    expected = race_reference(tiny_target, SAMPLING, PROMPT, MAX_NEW)
    assert all(out == expected for out in outputs.values()), (outputs, expected)
    other_seed = SamplingParams(0.9, 50, 0.95, seed=99)
    assert generate(tiny_server.address, "pld", None, other_seed, race).output_ids != expected


@pytest.mark.parametrize("mode", [None, AcceptanceMode.TOPK_DRAFTS,
                                  AcceptanceMode.SAMPLED_DRAFTS])
def test_seeded_sampling_replays(tiny_server, mode):
    runs = [generate(tiny_server.address, "aded", 8, SAMPLING, mode).output_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) > 0


@pytest.mark.parametrize("mode", [AcceptanceMode.TOPK_DRAFTS, AcceptanceMode.SAMPLED_DRAFTS])
@pytest.mark.parametrize("drafter", ["pld", "aded"])
def test_sampling_with_temperature_zero_is_greedy(tiny_server, mode, drafter):
    greedy = generate(tiny_server.address, drafter, 8, SamplingParams(), None).output_ids
    sampled = generate(tiny_server.address, drafter, 8, SamplingParams(seed=3), mode)
    assert sampled.output_ids == greedy
    assert sampled.accepted_tokens > 0


@pytest.mark.parametrize("sampling, mode, words", [
    (pb.Sampling(temperature=0.8), pb.ACCEPTANCE_MODE_GREEDY, "greedy acceptance"),
    (pb.Sampling(temperature=-1.0), pb.ACCEPTANCE_MODE_UNSPECIFIED, "temperature"),
    (pb.Sampling(temperature=0.8, top_p=1.5), pb.ACCEPTANCE_MODE_UNSPECIFIED, "top_p"),
])
def test_unusable_sampling_is_refused(tiny_server, sampling, mode, words):
    import grpc

    msg = open_msg()
    msg.open.sampling.CopyFrom(sampling)
    msg.open.acceptance = mode
    assert_refused(tiny_server.address, [msg], grpc.StatusCode.INVALID_ARGUMENT, words)


def test_stop_strings_and_stop_ids_end_the_generation(tiny_server, tiny_target):
    from testkit.tiny_model import byte_tokenizer

    tokenizer = byte_tokenizer()
    full = generate(tiny_server.address, "pld", 8, SamplingParams(), None).output_ids
    text = tokenizer.decode(full, skip_special_tokens=True)
    stop = text[5:8]  # a string the greedy answer is known to contain

    async def go(**stops):
        options = ClientOptions("pld", 8, MAX_NEW)
        async with EdgeClient(tiny_server.address, options) as client:
            request = options.open_request(prompt_ids=PROMPT)
            return await client.generate(dataclasses.replace(request, **stops))

    by_string = asyncio.run(go(stop_strings=(stop,)))
    cut_text = tokenizer.decode(by_string.output_ids, skip_special_tokens=True)
    assert stop in cut_text
    assert stop not in tokenizer.decode(by_string.output_ids[:-1], skip_special_tokens=True)
    assert by_string.output_ids == full[: len(by_string.output_ids)]
    assert by_string.finish_reason.name == "STOP_STRING"
    by_id = asyncio.run(go(stop_token_ids=(full[3],)))
    assert by_id.output_ids == full[: full.index(full[3]) + 1]
    assert by_id.finish_reason.name == "STOP_TOKEN"


def test_q_is_refused_outside_sampled_drafts_and_checked_within(tiny_server):
    import grpc

    draft = pb.ClientMessage(draft=pb.Draft(round_id=1, base_length=len(PROMPT) + 1,
                                            tokens=[5], parents=[-1]))
    with_q = pb.ClientMessage()
    with_q.CopyFrom(draft)
    with_q.draft.q.add(node=-1, tokens=[5], probs=[1.0])
    greedy = open_msg(PROMPT)
    assert_refused(tiny_server.address, [greedy, with_q], grpc.StatusCode.INVALID_ARGUMENT,
                   "sampled-drafts")
    sampled = open_msg(PROMPT)
    sampled.open.sampling.temperature = 0.8
    sampled.open.acceptance = pb.ACCEPTANCE_MODE_SAMPLED_DRAFTS
    assert_refused(tiny_server.address, [sampled, draft], grpc.StatusCode.INVALID_ARGUMENT,
                   "need q")
    bad = pb.ClientMessage()
    bad.CopyFrom(with_q)
    bad.draft.q[0].probs[0] = float("nan")
    assert_refused(tiny_server.address, [sampled, bad], grpc.StatusCode.INVALID_ARGUMENT,
                   "not a distribution")


def test_bad_stops_are_refused(tiny_server):
    import grpc

    msg = open_msg()
    msg.open.stop_token_ids.append(100000)
    assert_refused(tiny_server.address, [msg], grpc.StatusCode.INVALID_ARGUMENT, "stop token")
    msg = open_msg()
    msg.open.stop_strings.append("")
    assert_refused(tiny_server.address, [msg], grpc.StatusCode.INVALID_ARGUMENT, "stop strings")
