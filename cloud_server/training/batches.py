"""Training batches from (prompt, answer) samples, for any drafter trained on the target's own
answers: similar lengths together, a frequency-ranked draft vocabulary, padded tensors with the
positions whose next token is an answer token."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from cloud_server.training.data import Sample


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [batch, T], right-padded
    attention: torch.Tensor  # [batch, T], 1 on real tokens
    select: torch.Tensor  # [batch, T] bool: positions whose next token is an answer token
    prompt_lens: list[int]
    # the samples' stored layer outputs [batch, T, L, width], zeros past each sample's end;
    # None unless every sample carries them (data.Sample.features)
    features: torch.Tensor | None = None


def rank_vocab(samples: list[Sample], size: int, keep: tuple[int, ...],
               vocab_size: int) -> torch.Tensor:
    """A draft head's `size` token ids: `keep` (the stop tokens), then answer tokens by
    frequency, then prompt tokens by frequency, then the lowest ids not in yet (BPE ids grow
    roughly with rarity). Filling matters: 517 answers of SmolLM2 held only 5.5k distinct
    tokens, which covered just 80-85% of the evaluation prompts' tokens."""
    ranked = dict.fromkeys(keep)
    for counts in (Counter(t for s in samples for t in s.answer_ids),
                   Counter(t for s in samples for t in s.prompt_ids)):
        by_count = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        ranked |= dict.fromkeys(t for t, _ in by_count)
    ranked |= dict.fromkeys(range(vocab_size))
    return torch.tensor(list(ranked)[:size])


def make_batches(samples: list[Sample], batch_tokens: int, max_len: int, seed: int,
                 epoch: int) -> list[list[int]]:
    """Sample indices per batch of at most `batch_tokens` padded tokens: similar lengths
    together (the same batches every epoch), in an order shuffled per epoch."""
    def length(i: int) -> int:
        return min(len(samples[i].prompt_ids) + len(samples[i].answer_ids), max_len)

    order = sorted(range(len(samples)), key=lambda i: (length(i), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending length: the newest sample sets the padded width
        if current and length(i) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    batches.append(current)
    random.Random(seed * 1000 + epoch).shuffle(batches)
    return batches


def collate(samples: list[Sample], pad: int, max_len: int, device: torch.device) -> Batch:
    seqs = [list(s.prompt_ids + s.answer_ids)[:max_len] for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)  # [b, T]
    positions = torch.arange(width, device=device)[None]  # [1, T]
    lengths = torch.tensor([len(s) for s in seqs], device=device)[:, None]  # [b, 1]
    prompt = torch.tensor([len(s.prompt_ids) for s in samples], device=device)[:, None]
    # Position i predicts token i + 1; the server itself gives the answer's first token, so the
    # drafter's job starts at the first answer position (boundaries.py).
    select = (positions >= prompt) & (positions < lengths - 1)  # [b, T]
    return Batch(ids, (positions < lengths).long(), select, prompt[:, 0].tolist(),
                 _features(samples, width, max_len, device))


def _features(samples: list[Sample], width: int, max_len: int,
              device: torch.device) -> torch.Tensor | None:
    """The samples' features cut to `max_len` and padded to `width` positions."""
    if not samples or any(s.features is None for s in samples):
        return None
    rows = [s.features[:max_len] for s in samples if s.features is not None]
    padded = torch.zeros((len(rows), width, *rows[0].shape[1:]), dtype=rows[0].dtype)
    for b, row in enumerate(rows):
        padded[b, :len(row)] = row
    return padded.to(device)
