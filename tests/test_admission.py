"""Admission (cloud_server/decoding/admission.py) on the tiny target, no forward run: a valid
request becomes the spec a session generates from, and each bad one is refused with the
message the client sees as INVALID_ARGUMENT."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cloud_server.decoding.admission import MAX_STOP_CHARS, MAX_STOP_STRINGS, admit
from shared.acceptance import AcceptanceMode
from shared.errors import InvalidRequest
from shared.messages import (
    ActivationFormat, ChatMessage, FinishReason, Limits, OpenRequest, Pace, Resume,
)
from shared.sampling import SamplingParams

LIMITS = Limits(max_tree_depth=8, max_prompt_tokens=64, max_new_tokens=64)
REQUEST = OpenRequest(prompt_ids=(5, 6, 7), max_new_tokens=10)
HOT = SamplingParams(temperature=0.8, seed=11)


def refusal(target, request: OpenRequest, limits: Limits = LIMITS) -> str:
    with pytest.raises(InvalidRequest) as err:
        admit(request, target, limits, serves_activations=False)
    return str(err.value)


def test_a_valid_request_becomes_its_spec(tiny_target):
    request = replace(REQUEST, stop_token_ids=(9,), stop_strings=("x",),
                      resume=Resume("s", (8, 9 + 1)), sampling=HOT, pace=Pace.SERVER, lead=3)
    spec = admit(request, tiny_target, LIMITS, serves_activations=False)
    assert (spec.prompt_ids, spec.history) == ((5, 6, 7), (8, 10))
    assert (spec.max_new_tokens, spec.cap_reason) == (10, FinishReason.LENGTH)
    assert (spec.acceptance, spec.seed) == (AcceptanceMode.TOPK_DRAFTS, 11)
    assert spec.stops.token_ids == {9, *tiny_target.stop_token_ids()}
    assert spec.stops.strings == ("x",)
    assert (spec.pace, spec.lead) == (Pace.SERVER, 3)


def test_defaults_greedy_lockstep_and_the_servers_budget(tiny_target):
    spec = admit(replace(REQUEST, max_new_tokens=0), tiny_target, LIMITS, False)
    assert (spec.acceptance, spec.pace) == (AcceptanceMode.GREEDY, Pace.LOCKSTEP)
    assert (spec.max_new_tokens, spec.cap_reason) == (64, FinishReason.LENGTH)


def test_a_chat_is_templated(tiny_target):
    chat = (ChatMessage("user", "hi"),)
    spec = admit(OpenRequest(chat=chat), tiny_target, LIMITS, False)
    assert spec.prompt_ids == tuple(tiny_target.apply_chat_template(chat))


def test_the_context_caps_the_budget(tiny_target):
    prompt = (5,) * (tiny_target.max_context - LIMITS.max_tree_depth - 1 - 4)
    limits = replace(LIMITS, max_prompt_tokens=len(prompt))
    spec = admit(replace(REQUEST, prompt_ids=prompt), tiny_target, limits, False)
    assert (spec.max_new_tokens, spec.cap_reason) == (4, FinishReason.CONTEXT)
    full = (5,) * (tiny_target.max_context - LIMITS.max_tree_depth - 1)
    assert "leaves no room" in refusal(tiny_target, replace(REQUEST, prompt_ids=full),
                                       replace(LIMITS, max_prompt_tokens=len(full)))


def test_rows_need_a_server_that_sends_them(tiny_target):
    request = replace(REQUEST, activations=ActivationFormat.FP16)
    assert "sends no activations" in refusal(tiny_target, request)
    spec = admit(request, tiny_target, LIMITS, serves_activations=True)
    assert spec.activations is ActivationFormat.FP16


@pytest.mark.parametrize("change, message", [
    (dict(prompt_ids=None, chat=()), "chat prompt has no messages"),
    (dict(prompt_ids=()), "prompt is empty"),
    (dict(prompt_ids=(5,) * 65), "prompt has 65 tokens, the limit is 64"),
    (dict(prompt_ids=(5, 320)), "prompt token id 320 is outside [0, 320)"),
    (dict(max_new_tokens=65), "max_new_tokens 65 is over the server's limit 64"),
    (dict(acceptance=AcceptanceMode.GREEDY, sampling=HOT), "greedy acceptance with temperature"),
    (dict(stop_token_ids=(-1,)), "stop token id -1 is outside"),
    (dict(stop_strings=("s",) * (MAX_STOP_STRINGS + 1)), f"the limit is {MAX_STOP_STRINGS}"),
    (dict(stop_strings=("",)), f"1 to {MAX_STOP_CHARS} characters"),
    (dict(stop_strings=("s" * (MAX_STOP_CHARS + 1),)), f"1 to {MAX_STOP_CHARS} characters"),
    (dict(resume=Resume("s", (8,) * 10)), "resume brings 10 generated tokens"),
    (dict(resume=Resume("s", (8, 999))), "resumed token id 999 is outside"),
    (dict(resume=Resume("s", (8, 2))), "ends the generation at token 1 (stop_token)"),
    (dict(protocol_version=1), "the client speaks protocol 1, this server 2: upgrade the client"),
    (dict(protocol_version=0), "the client speaks protocol 1,"),  # protocol 1 never set it
    (dict(protocol_version=3), "the client speaks protocol 3, this server 2"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_bad_request_is_refused(tiny_target, change, message):
    assert message in refusal(tiny_target, replace(REQUEST, **change))


def test_a_resumed_history_that_spelled_a_stop_string_is_refused(tiny_target):
    history = tuple(tiny_target.tokenizer.encode("ab", add_special_tokens=False))
    request = replace(REQUEST, stop_strings=("ab",), resume=Resume("s", history))
    assert "(stop_string)" in refusal(tiny_target, request)


def test_a_client_of_another_protocol_hears_that_before_anything_else(tiny_target):
    """Whatever else is wrong with its request, an older client is told to upgrade: it would
    misread any other answer (a protocol 1 client leaves the version unset)."""
    request = replace(REQUEST, protocol_version=0, prompt_ids=(), max_new_tokens=65)
    assert "upgrade the client" in refusal(tiny_target, request)
