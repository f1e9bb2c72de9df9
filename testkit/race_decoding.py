"""The exponential race's reference text: token-by-token decoding under the target alone, each
token the race winner under p (shared/sampling.py). Split decoding under the race rule must
write exactly this, whatever the drafts."""
from __future__ import annotations

from typing import Sequence

import torch

from shared.sampling import SamplingParams, race_noise, race_winner, warp


@torch.inference_mode()
def race_reference(target, sampling: SamplingParams, prompt: Sequence[int],
                   max_new: int) -> list[int]:
    """The tokens after `prompt`, `max_new` at most, up to a stop token."""
    ids, stops = list(prompt), set(target.stop_token_ids())
    while len(ids) - len(prompt) < max_new:
        ids_on_device = torch.tensor([ids], device=target.device)  # [1, len(ids)]
        logits = target.model(input_ids=ids_on_device).logits[0, -1].float().cpu().numpy()
        ids.append(race_winner(warp(logits, sampling),
                               race_noise(sampling.seed, len(ids), target.vocab_size)))
        if ids[-1] in stops:
            break
    return ids[len(prompt):]
