"""OpenAI request bodies in, the client's own requests out.

A field the request leaves out takes the value of the `edge-client serve` flag of the same
meaning (as llama.cpp's server does), so a request with no sampling fields decodes as the CLI
would. A field the endpoint cannot honour is refused with its name, never ignored.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from edge_client.client import ClientOptions
from shared.messages import ChatMessage
from shared.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # as OpenAI's API
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields that change what an answer is and that split decoding does not offer.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "top_logprobs", "suffix", "audio", "modalities", "prediction")


class ApiError(Exception):
    """A request the endpoint refuses, in the terms of OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)
        self.headers = dict(headers or {})  # e.g. a 429's Retry-After


class Kind(enum.Enum):
    CHAT = "chat.completion"
    TEXT = "text_completion"


@dataclass(frozen=True)
class ApiRequest:
    kind: Kind
    model: str | None
    options: ClientOptions  # the serve flags with the request's fields applied
    chat: tuple[ChatMessage, ...] | None = None  # Kind.CHAT: the server applies the template
    prompt: str | tuple[int, ...] | None = None  # Kind.TEXT: text or token ids, as given
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    allow_unverified: bool = False  # extension: keep text the target never checked


def parse_chat(body: Any, defaults: ClientOptions) -> ApiRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    chat = tuple(_message(m, i) for i, m in enumerate(messages))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return _request(Kind.CHAT, body, defaults, max_tokens, chat=chat)


def parse_completion(body: Any, defaults: ClientOptions) -> ApiRequest:
    body = _object(body)
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1", "best_of")
    if body.get("logprobs") is not None:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    prompt = _prompt(body.get("prompt"))
    return _request(Kind.TEXT, body, defaults, body.get("max_tokens"), prompt=prompt)


def _request(kind: Kind, body: Mapping[str, Any], defaults: ClientOptions,
             max_tokens: Any, **content: Any) -> ApiRequest:
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise ApiError(400, f"{name} is not supported by this endpoint", name)
    if kind is Kind.CHAT and body.get("logprobs"):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) != 0:
            raise ApiError(400, f"{name} is not supported (must be 0)", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return ApiRequest(kind, model, _options(body, defaults, max_tokens), **content,
                      stream=_flag(body, "stream"),
                      include_usage=_flag(stream_options, "include_usage"),
                      allow_unverified=_flag(body, "allow_unverified"))


def _options(body: Mapping[str, Any], defaults: ClientOptions, max_tokens: Any) -> ClientOptions:
    d = defaults.sampling
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", d.temperature, 0.0, 2.0),
            top_k=_integer(body.get("top_k"), "top_k", d.top_k, 0),
            top_p=_number(body, "top_p", d.top_p, 0.0, 1.0),
            seed=_integer(body.get("seed"), "seed", d.seed, None))
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    return replace(defaults, sampling=sampling,
                   max_new_tokens=_integer(max_tokens, "max_tokens", defaults.max_new_tokens, 1),
                   stop_strings=_stops(body.get("stop"), defaults.stop_strings))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _message(m: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"{param}: role must be one of {', '.join(ROLES)}", param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{param}: only text content parts are supported", param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}: content must be a string or text parts", param)
    return ChatMessage(ROLES[m["role"]], content)


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return tuple(prompt)
    raise ApiError(400, "prompt must be one non-empty string or one list of token ids "
                        "(one prompt per request)", "prompt")


def _stops(stop: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if stop is None:
        return default
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most "
                            f"{MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"{name} must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _integer(value: Any, name: str, default: Any, lo: int | None) -> Any:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if lo is not None and value < lo:
        raise ApiError(400, f"{name} must be at least {lo}, got {value}", name)
    return value


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise ApiError(400, f"{name} must be true or false", name)
    return bool(value)
