"""Plain greedy decoding of the target, and the rule that judges split output against it.

Split decoding must emit exactly what plain greedy decoding emits. A tree forward and a
one-token step add in a different order (other kernels for other shapes), so where the target's
top two logits are within rounding of each other the two may pick different tokens. The
near-tie rule, stated once: such a divergence is allowed only when the top-2 gap at that
position is below `near_tie(dtype, top)`: NEAR_TIE in fp32, and in bf16 or fp16, whose logits
are stored to 8 or 11 bits, HALF_TIE_ULPS units in the last place of the top logit
(docs/architecture.md, Verification).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from cloud_server.target import TargetModel
from shared.tree import DraftTree

NEAR_TIE = 1e-3
HALF_TIE_ULPS = 4


def near_tie(dtype: torch.dtype, top: float) -> float:
    """The largest top-2 gap at which a divergence is a near-tie, for a target in `dtype`
    whose top logit there is `top`."""
    if dtype == torch.float32:
        return NEAR_TIE
    return HALF_TIE_ULPS * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(top) or 1))


@torch.inference_mode()
def plain_greedy(target: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, stopping at the target's stop tokens (kept); with
    another engine than the modules, that engine's own decoding steps."""
    if not target.engine.exact_reference:
        return _stepped_greedy(target, prompt_ids, max_new_tokens)
    ids = torch.tensor([list(prompt_ids)], device=target.device)
    stops = list(target.stop_token_ids())
    generate = target.model.generate  # causal LMs mix it in; PreTrainedModel's stub lacks it
    out = generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,  # type: ignore[operator]
                   max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=stops[0],
                   top_p=None, top_k=None, temperature=None)
    return out[0, ids.shape[1]:].tolist()


def _stepped_greedy(target: TargetModel, prompt_ids: Sequence[int], max_new_tokens: int
                    ) -> list[int]:
    """Greedy decoding one token a forward through the target's own forward pass."""
    stops = set(target.stop_token_ids())
    cache, logits = target.prefill(list(prompt_ids))
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(int(logits.argmax()))
        if out[-1] in stops or len(out) == max_new_tokens:
            break
        logits = target.forward_tree(cache, out[-1], DraftTree.chain([]))[0]
    return out


@dataclass(frozen=True)
class Comparison:
    divergence: int | None  # first index where the outputs differ, None when equal
    top2_gap: float  # the target's top-2 logit gap there (inf when equal)
    tie: float = NEAR_TIE  # the near-tie bound there (near_tie)

    @property
    def lossless(self) -> bool:
        return self.divergence is None or self.top2_gap < self.tie


@torch.inference_mode()
def compare(target: TargetModel, prompt_ids: Sequence[int], split: Sequence[int],
            plain: Sequence[int]) -> Comparison:
    """Where `split` first departs from `plain`, and how close the target's call was there."""
    n = min(len(split), len(plain))
    j = next((i for i in range(n) if split[i] != plain[i]), None)
    if j is None:
        # One may simply be a prefix of the other when both stopped at a length limit.
        return Comparison(None if len(split) == len(plain) else n, float("inf"))
    ids = list(prompt_ids) + list(plain[:j])
    if not target.engine.exact_reference:
        logits = target.prefill(ids)[1]
    else:
        logits = target.model(input_ids=torch.tensor([ids], device=target.device)).logits[0, -1]
    top2 = torch.topk(logits.float(), 2).values
    return Comparison(j, float(top2[0] - top2[1]), near_tie(target.model.dtype, float(top2[0])))
