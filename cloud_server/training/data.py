"""Training text for the drafter: training prompts answered by the frozen target itself.

On-policy self-distillation (docs/architecture.md, Drafters): the drafter must predict what *this* target
writes, so the target answers the prompts greedily (the acceptance the tau target is set for)
and the answers are cached on disk, one JSON line per prompt, so a resumed run skips what is
done. Prompts come from prompt_sources.py (never evaluation prompts; a test checks it).
Knows nothing of the drafter or the loss.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from transformers import DynamicCache

from shared import progress
from cloud_server.target import TargetModel
from shared.messages import ChatMessage

SORT_WINDOW = 1024  # prompts answered in windows sorted by length (generate_answers)


@dataclass(frozen=True)
class Sample:
    prompt_ids: tuple[int, ...]  # chat-templated prompt, ends where the answer starts
    answer_ids: tuple[int, ...]  # the target's greedy answer, stop token included if reached
    # the target's captured layer outputs at every position, [len(prompt + answer), L, width],
    # where the answers came with them (engine_answers.py; None: the trainer runs the target)
    features: torch.Tensor | None = field(default=None, compare=False, repr=False)


def encode_prompts(target: TargetModel, prompts: list[str],
                   max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated ids, dropping prompts longer than `max_prompt_tokens`."""
    encoded = (target.apply_chat_template((ChatMessage("user", p),)) for p in prompts)
    return [ids for ids in encoded if len(ids) <= max_prompt_tokens]


@torch.inference_mode()
def answer_batch(target: TargetModel, batch: list[list[int]], max_new_tokens: int,
                 sampler: torch.Generator | None = None) -> list[list[int]]:
    """Greedy answers of a batch of left-padded prompts (with `sampler`, drawn at temperature
    1 instead); each ends at its first stop token, and leaves the batch there.

    A plain decode loop rather than `generate`: on this 2-core CPU `generate` ran a batch of 16
    at ~7 tokens/s, this loop at ~200 (batch 16) to ~350 (batch 32)."""
    stops = torch.tensor(target.stop_token_ids(), device=target.device)
    width = max(map(len, batch))
    ids = torch.tensor([[int(stops[0])] * (width - len(p)) + p for p in batch],
                       device=target.device)  # [batch, width]
    attention = (torch.arange(width, device=target.device)[None]
                 >= torch.tensor([width - len(p) for p in batch], device=target.device)[:, None])
    attention = attention.long()  # [batch, width]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
    cache = DynamicCache(config=target.model.config)
    logits = target.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                          past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    last = positions[:, -1:]  # [batch, 1]
    rows = torch.arange(len(batch), device=target.device)  # [live]: batch row of each live row
    answers: list[list[int]] = [[] for _ in batch]
    for _ in range(max_new_tokens):
        token = (logits[:, -1].argmax(-1) if sampler is None else torch.multinomial(
            logits[:, -1].float().softmax(-1), 1, generator=sampler)[:, 0])  # [live]
        for row, t in zip(rows.tolist(), token.tolist()):
            answers[row].append(t)
        live = ~torch.isin(token, stops)  # [live]
        if not bool(live.any()):
            break
        if not bool(live.all()):  # finished rows leave the batch: no step is spent on them
            keep = live.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, token, attention, last = rows[keep], token[keep], attention[keep], last[keep]
        attention = torch.cat((attention, torch.ones_like(attention[:, :1])), dim=1)
        last = last + 1
        logits = target.model(input_ids=token[:, None], attention_mask=attention,
                              position_ids=last, past_key_values=cache, use_cache=True).logits
    return answers


def generate_answers(target: TargetModel, prompts: list[list[int]], path: Path,
                     batch_size: int, max_new_tokens: int) -> None:
    """Appends {"prompt_ids", "answer_ids"} lines to `path` for the prompts not answered yet,
    found by their ids, so a rerun resumes whatever order the file was written in.

    Batches are left-padded to their longest prompt, so the prompts are answered in windows of
    SORT_WINDOW, each sorted by length: that ran 2.2x faster than in their given order (2-core
    CPU, batch 48, 64 new tokens), and any prefix of the file still mixes every source."""
    answered = {tuple(row["prompt_ids"]) for row in rows(path)} if path.exists() else set()
    todo = [p for p in prompts if tuple(p) not in answered]
    todo = [p for w in range(0, len(todo), SORT_WINDOW)
            for p in sorted(todo[w:w + SORT_WINDOW], key=len)]
    done = len(prompts) - len(todo)
    start, produced = time.monotonic(), 0
    with path.open("a") as f, progress.bar(len(prompts), "answers", "prompt", initial=done) as bar:
        for i in range(0, len(todo), batch_size):
            batch = todo[i:i + batch_size]
            for prompt, answer in zip(batch, answer_batch(target, batch, max_new_tokens)):
                f.write(json.dumps({"prompt_ids": prompt, "answer_ids": answer}) + "\n")
                produced += len(answer)
            f.flush()
            elapsed = time.monotonic() - start
            bar.update(len(batch))
            bar.set_postfix_str(f"{produced / elapsed:.0f} tokens/s")
            if progress.log_lines():
                finished = done + i + len(batch)
                print(f"answers {finished}/{len(prompts)}  {produced / elapsed:.0f} tokens/s  "
                      f"ETA {elapsed / (i + len(batch)) * (len(todo) - i - len(batch)):.0f} s",
                      file=sys.stderr, flush=True)


def load_samples(path: Path) -> list[Sample]:
    return [Sample(tuple(row["prompt_ids"]), tuple(row["answer_ids"])) for row in rows(path)]


def rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".json":
        yield from json.loads(path.read_text())
        return
    with path.open() as f:
        yield from (json.loads(line) for line in f if line.strip())
