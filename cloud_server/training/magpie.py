"""Self-synthesised training prompts (Magpie, Xu et al. 2024, arXiv 2406.08464): given only the
chat template's opening of a user turn, the target writes the user's message itself, drawn at
temperature 1. What it writes is what it expects to be asked, so the answers to those prompts
are text it produces on the job. Filtered for length, language and duplicates, and
decontaminated like every other source (prompt_sources.py)."""
from __future__ import annotations

import torch

from cloud_server.target import TargetModel
from cloud_server.training.data import answer_batch
from cloud_server.training.prompt_sources import HeldOut, english, evaluation_texts, opening
from shared import progress
from shared.messages import ChatMessage

MARK = "\u2063MAGPIE\u2063"  # a placeholder no template changes
MIN_CHARS, MAX_CHARS = 16, 1000


def user_turn_prefix(target: TargetModel) -> list[int]:
    """The template's text up to where a user's first message begins (a system turn the
    template adds by default included)."""
    ids = target.apply_chat_template((ChatMessage("user", MARK),))
    text = target.tokenizer.decode(ids)
    if MARK not in text:
        raise ValueError(f"{target.model_id}'s chat template hides the user's message")
    return target.tokenizer.encode(text[:text.index(MARK)], add_special_tokens=False)


def synthesize(target: TargetModel, count: int, batch_size: int = 32,
               max_new_tokens: int = 128, seed: int = 0) -> list[str]:
    """Up to `count` distinct user prompts written by the target; stops after as many tries
    as `count` would take four times over, so a target that repeats itself ends early."""
    prefix = user_turn_prefix(target)
    sampler = torch.Generator(device=target.device).manual_seed(seed)
    found: dict[str, str] = {}  # opening -> prompt: near-copies count once
    held = HeldOut(evaluation_texts())
    with progress.bar(count, "magpie prompts", "prompt") as bar:
        for _ in range(4 * -(-count // batch_size)):
            rows = answer_batch(target, [prefix] * batch_size, max_new_tokens, sampler)
            for text in (str(target.tokenizer.decode(r, skip_special_tokens=True)).strip()
                         for r in rows):
                if (MIN_CHARS <= len(text) <= MAX_CHARS and english(text)
                        and opening(text) not in found and not held.touches(text)):
                    found[opening(text)] = text
                    bar.update()
            if len(found) >= count:
                break
    return list(found.values())[:count]
