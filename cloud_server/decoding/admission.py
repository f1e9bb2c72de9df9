"""Admission: an OpenRequest checked against the target and the server's limits, once.

`admit` turns a request into the SessionSpec a Session generates from, or refuses it with
InvalidRequest and a message for the client (INVALID_ARGUMENT at the gRPC boundary). It runs
no forward and holds no state, so every refusal is testable without a model; the session then
trusts its spec. Pace and lead arrive resolved (the service's PacingPolicy).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from cloud_server.decoding.stops import StopRule
from cloud_server.target import TargetModel
from shared.acceptance import AcceptanceMode
from shared.errors import InvalidRequest
from shared.messages import (
    PROTOCOL_VERSION, ActivationFormat, FinishReason, Limits, OpenRequest, Pace,
)
from shared.sampling import SamplingParams

DEFAULT_SAMPLING_MODE = AcceptanceMode.TOPK_DRAFTS
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass(frozen=True)
class SessionSpec:
    """A validated request: what a Session needs to generate."""

    limits: Limits
    prompt_ids: tuple[int, ...]
    history: tuple[int, ...]  # the generated tokens a resume brings (replayed by the prefill)
    max_new_tokens: int
    cap_reason: FinishReason  # why the generation ends at max_new_tokens: LENGTH or CONTEXT
    sampling: SamplingParams
    acceptance: AcceptanceMode
    seed: int
    stops: StopRule
    activations: ActivationFormat | None  # the rows the edge's drafter reads, if any
    pace: Pace
    lead: int


def admit(request: OpenRequest, target: TargetModel, limits: Limits,
          serves_activations: bool) -> SessionSpec:
    """The spec of the session `request` opens, checked in the order a client fixes its
    request. `serves_activations`: this server computes rows for the edge's drafter."""
    check_protocol(request)
    prompt = prompt_ids(request, target, limits)
    budget, cap_reason = token_budget(request.max_new_tokens, len(prompt), target, limits)
    acceptance = acceptance_mode(request)
    seed = secrets.randbits(63) if request.sampling.seed is None else request.sampling.seed
    stops = stop_rule(request, target)
    history = resumed_history(request, budget, target, stops)
    if request.activations is not None and not serves_activations:
        raise InvalidRequest(f"this server has no drafter for {target.model_id} and sends "
                             "no activations: choose a drafter that needs none")
    return SessionSpec(
        limits, prompt, history, budget, cap_reason, request.sampling, acceptance, seed, stops,
        request.activations, request.pace or Pace.LOCKSTEP, request.lead)


def check_protocol(request: OpenRequest) -> None:
    """A client of another protocol version would misread the Verdicts: refused, by name."""
    if request.protocol_version != PROTOCOL_VERSION:
        raise InvalidRequest(f"the client speaks protocol {request.protocol_version or 1}, "
                             f"this server {PROTOCOL_VERSION}: upgrade the client")


def prompt_ids(request: OpenRequest, target: TargetModel, limits: Limits) -> tuple[int, ...]:
    """The prompt as token ids: as given, or the chat through the target's template."""
    if request.chat is not None:
        if not request.chat:
            raise InvalidRequest("chat prompt has no messages")
        ids = tuple(target.apply_chat_template(request.chat))
    else:
        ids = tuple(request.prompt_ids or ())
    if not ids:
        raise InvalidRequest("prompt is empty")
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens, the limit is {limits.max_prompt_tokens}")
    check_ids(ids, target.vocab_size, "prompt token")
    return ids


def token_budget(requested: int, prompt_len: int, target: TargetModel, limits: Limits
                 ) -> tuple[int, FinishReason]:
    """The most new tokens (0 asks for the server's limit), cut to what the context leaves
    beside the deepest tree, and the finish reason for reaching it."""
    limit = limits.max_new_tokens
    if requested > limit:
        raise InvalidRequest(f"max_new_tokens {requested} is over the server's limit {limit}")
    room = target.max_context - prompt_len - limits.max_tree_depth - 1
    if room < 1:
        raise InvalidRequest(f"prompt of {prompt_len} tokens leaves no room in the "
                             f"model's context of {target.max_context}")
    wanted = requested or limit
    if room < wanted:
        return room, FinishReason.CONTEXT
    return wanted, FinishReason.LENGTH


def acceptance_mode(request: OpenRequest) -> AcceptanceMode:
    """The acceptance rule asked for; None: greedy when not sampling."""
    mode = request.acceptance
    if mode is None:
        return AcceptanceMode.GREEDY if request.sampling.greedy else DEFAULT_SAMPLING_MODE
    if mode is AcceptanceMode.GREEDY and not request.sampling.greedy:
        raise InvalidRequest("greedy acceptance with temperature > 0: choose a sampling "
                             "acceptance mode or temperature 0")
    return mode


def stop_rule(request: OpenRequest, target: TargetModel) -> StopRule:
    """The target's stop tokens with the request's, and the request's stop strings."""
    check_ids(request.stop_token_ids, target.vocab_size, "stop token")
    strings = request.stop_strings
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{len(strings)} stop strings, the limit is {MAX_STOP_STRINGS}")
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in strings):
        raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
    return StopRule(frozenset(target.stop_token_ids()) | frozenset(request.stop_token_ids),
                    strings, target.tokenizer)


def resumed_history(request: OpenRequest, budget: int, target: TargetModel, stops: StopRule
                    ) -> tuple[int, ...]:
    """The generated tokens a resume brings, which must leave budget and must not have ended
    the generation already."""
    if request.resume is None:
        return ()
    history = tuple(request.resume.generated_ids)
    if len(history) >= budget:
        raise InvalidRequest(f"resume brings {len(history)} generated tokens; the session "
                             f"allows {budget}")
    check_ids(history, target.vocab_size, "resumed token")
    stop = stops.first_stop(history)
    if stop is not None:
        raise InvalidRequest(f"resume history ends the generation at token {stop[0]} "
                             f"({stop[1].name.lower()}): a finished generation cannot "
                             "go on")
    return history


def check_ids(ids: tuple[int, ...], vocab: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{what} id {bad} is outside [0, {vocab})")
