"""Batch mode: prompts from JSONL in, one result line per prompt out.

Input lines: {"id", "prompt"} (chat template applied), {"id", "messages": [...]}, or
{"id", "input_ids": [...]} (used as given). Output field names are a contract: benchmarks and
outside scripts read them.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from edge_client.client import ClientOptions, EdgeClient
from edge_client.reporting import GenerationResult
from edge_client.link import LinkError, ServerUnreachable
from edge_client.server_only import Mode
from shared.messages import ChatMessage, OpenRequest


class BadInput(ValueError):
    """A prompts file line that cannot be turned into a request."""


def read_prompts(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise BadInput(f"{path}:{lineno}: not JSON ({err.msg})") from None


def to_request(item: dict[str, Any], options: ClientOptions) -> OpenRequest:
    if "input_ids" in item:
        ids = item["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise BadInput("input_ids must be a list of integers")
        return options.open_request(prompt_ids=ids)
    if "messages" in item:
        try:
            chat = tuple(ChatMessage(str(m["role"]), str(m["content"])) for m in item["messages"])
        except (KeyError, TypeError):
            raise BadInput("messages must be a list of {role, content}") from None
        return options.open_request(chat=chat)
    if isinstance(item.get("prompt"), str):
        return options.open_request(chat=(ChatMessage("user", item["prompt"]),))
    raise BadInput("each line needs one of: prompt, messages, input_ids")


def result_record(item_id: Any, result: GenerationResult, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "output_ids": result.output_ids,
        "text": text,
        "finish_reason": result.finish_reason.name.lower(),
        "prompt_tokens": len(result.prompt_ids),
        "new_tokens": len(result.output_ids),
        "rounds": result.rounds,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
        "tau": round(result.tau, 4),
        "server_calls": result.server_calls,
        "tokens_per_s": round(result.tokens_per_s, 3),
        "wall_s": round(result.wall_s, 4),
        "ttft_s": round(result.ttft_s, 4),
        "verify_s": round(result.verify_s, 4),
        "bytes_up": result.bytes_up,
        "bytes_down": result.bytes_down,
        "offline_tokens": result.offline_tokens,
        "kept_tokens": result.kept_tokens,
        "corrected_tokens": result.corrected_tokens,
        "unverified_ids": result.unverified_ids,
        "reconnects": result.reconnects,
        "outage_s": round(result.outage_s, 3),
        "hidden_draft_s": round(result.hidden_draft_s, 4),
        # paced sessions: what became of the drafts (reporting.py, DraftOutcomes)
        **{f"drafts_{name}": value for name, value in asdict(result.drafts).items()},
    }


def method_record(options: ClientOptions, result: GenerationResult) -> dict[str, Any]:
    """How a line was generated, so runs in different modes and paces can be told apart: the
    pace is the one the session ran (the server resolves the one asked)."""
    split = options.mode is Mode.SPLIT
    return {"mode": options.mode.value, "drafter": options.drafter if split else None,
            "pace": result.pace.value if result.pace else None}


async def run_batch(client: EdgeClient, prompts: Path, out: Path) -> tuple[int, int]:
    """Generates for every line; a refused line gets an `error` record and the run goes on.
    Returns (succeeded, failed)."""
    ok = failed = 0
    with out.open("w") as sink:
        for lineno, item in read_prompts(prompts):
            item_id = item.get("id", lineno)
            try:
                request = to_request(item, client.options)
                result = await client.generate(request)
                record = result_record(item_id, result, client.decode(result.output_ids))
                record |= method_record(client.options, result)
                ok += 1
            except ServerUnreachable:
                raise
            except (BadInput, LinkError) as err:
                record = {"id": item_id, "error": str(err)}
                failed += 1
            sink.write(json.dumps(record) + "\n")
            sink.flush()
    return ok, failed
