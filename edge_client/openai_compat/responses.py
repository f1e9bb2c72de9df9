"""OpenAI response bodies: completions, stream chunks, usage, errors; plus what split decoding
adds, under `split_decoding` (an extension field that OpenAI's clients keep and ignore)."""
from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from edge_client.reporting import GenerationResult
from edge_client.openai_compat.requests import ApiError, ApiRequest, Kind
from shared.messages import FinishReason

# The answer was cut short (length or context cap; or the link was lost and the unverified
# rest was kept or dropped, which `split_decoding` tells).
FINISH = {FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop"}


@dataclass(frozen=True)
class Reply:
    """The fields every body of one answer shares."""

    request: ApiRequest
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, stream: bool) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.request.kind is Kind.CHAT else "cmpl-"
        kind = self.request.kind.value + (".chunk" if stream and self.request.kind is Kind.CHAT
                                          else "")
        return {"id": prefix + self.id, "object": kind, "created": self.created,
                "model": self.model}

    def completion(self, text: str, result: GenerationResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result),
                                  "logprobs": None}
        if self.request.kind is Kind.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self.head(False) | {"choices": [choice], "usage": usage(result),
                                   "split_decoding": split_stats(self.request, result)}

    def chunk(self, text: str | None = None, result: GenerationResult | None = None,
              first: bool = False) -> dict[str, Any]:
        """A stream chunk with new text, the first one (the role), or the last (`result`)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": None if result is None
                                  else finish_reason(result)}
        if self.request.kind is Kind.CHAT:
            choice["delta"] = ({"role": "assistant", "content": ""} if first
                               else {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        body = self.head(True) | {"choices": [choice]}
        if result is not None:
            body["split_decoding"] = split_stats(self.request, result)
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        return self.head(True) | {"choices": [], "usage": usage(result)}


def finish_reason(result: GenerationResult) -> str:
    return FINISH.get(result.finish_reason, "length")


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), len(result.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def split_stats(request: ApiRequest, result: GenerationResult) -> dict[str, Any]:
    options = request.options
    return {"mode": options.mode.value, "drafter": str(options.drafter),
            "pace": result.pace.value if result.pace else None,
            "tau": round(result.tau, 3), "rounds": result.rounds,
            "server_calls": result.server_calls, "tokens_per_s": round(result.tokens_per_s, 2),
            "ttft_s": round(result.ttft_s, 4), "offline_tokens": result.offline_tokens,
            "kept_tokens": result.kept_tokens, "corrected_tokens": result.corrected_tokens,
            "reconnects": result.reconnects,
            "unverified_tokens": len(result.unverified_ids),
            "unverified_included": bool(result.unverified_ids) and request.allow_unverified,
            "drafts": asdict(result.drafts)}


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param,
                      "code": err.code}}
