"""One forward for several sessions: their new tokens side by side in one row, each with its own
KV cache, positions and mask.

Orca's selective batching (Yu et al., OSDI 2022, section 4.2): the layers that see one token at
a time (projections, MLP, norms, the head) run on all sessions' tokens as one matrix, which is
where a small batch saves (the weights are read once instead of once per session); attention,
the only part that mixes tokens, runs per session on that session's cache. No cache is padded or
copied into a batch tensor: a session's cache grows in place exactly as in a forward of its own.

The adapter works inside transformers' attention interface: `RaggedCache.update` appends each
session's slice of the new keys and values to its own cache and hands the attention function
all of them (`RaggedStates`); the attention function registered by `install` then runs the
model's own attention implementation once per session, with the mask for the layer's sliding
window if it has one (session_mask.py). A forward that is not ragged passes straight through to
that implementation, so single-session forwards are unchanged; a target with sliding-window
layers runs all its forwards ragged, one session included (TargetModel).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cloud_server.engine.gqa_attention import grouped
from cloud_server.engine.session_mask import SessionMask

# A 4D attention_mask makes transformers skip building its own mask; the real masks are
# RaggedCache's, one per session.
PLACEHOLDER_MASK = torch.zeros(1, 1, 1, 1)


@dataclass(frozen=True)
class RaggedStates:
    """One layer's keys (or values) of every session in a ragged forward, each [1, kv_heads,
    cached + new, head_dim], with each session's mask."""

    parts: tuple[torch.Tensor, ...]
    masks: tuple[SessionMask, ...]


class RaggedCache:
    """Stands in for the model's cache during a ragged forward: splits each layer's new keys
    and values by session and appends them to that session's DynamicCache."""

    def __init__(self, caches: Sequence[DynamicCache], lengths: Sequence[int],
                 masks: Sequence[SessionMask]):
        self._caches = tuple(caches)
        self._lengths = list(lengths)
        self._masks = tuple(masks)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *_: Any,
               **__: Any) -> tuple[RaggedStates, RaggedStates]:
        grown = [cache.update(k, v, layer_idx) for cache, k, v in
                 zip(self._caches, keys.split(self._lengths, dim=2),
                     values.split(self._lengths, dim=2))]
        return (RaggedStates(tuple(k for k, _ in grown), self._masks),
                RaggedStates(tuple(v for _, v in grown), self._masks))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions are always given explicitly, so nothing should depend on this."""
        return 0


def _per_session(attention: Callable[..., tuple[torch.Tensor, Any]]):
    """The model's attention function, run once per session when the forward is ragged."""
    def attend(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if not isinstance(key, RaggedStates):
            return attention(module, query, key, value, attention_mask, **kwargs)
        outputs, start = [], 0
        for k, v, masks in zip(key.parts, value.parts, key.masks):
            mask = masks.for_window(kwargs.get("sliding_window"))
            new = mask.shape[-2]
            out, _ = attention(module, query[:, :, start: start + new], k, v, mask, **kwargs)
            outputs.append(out)  # [1, new, heads, head_dim]
            start += new
        return torch.cat(outputs, dim=1), None
    return attend


def _attention_function(model: Any, implementation: str) -> Callable[..., Any] | None:
    """transformers' attention function of that name; "eager" is each model's own (Gemma 2
    runs eager for its soft-capping)."""
    if implementation == "eager":
        return getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get(implementation)


def install(model: Any) -> bool:
    """Lets `model` run ragged forwards, and sdpa attention group its query heads in the
    kernel (gqa_attention.py); False where it cannot (an attention implementation outside
    transformers' interface, or a model that does not dispatch through it)."""
    original = model.config._attn_implementation
    if original.startswith("splitdec_ragged_"):
        return True
    attention = _attention_function(model, original)
    if attention is None or original not in ALL_MASK_ATTENTION_FUNCTIONS:
        return False
    if not model._can_set_attn_implementation():
        return False
    name = f"splitdec_ragged_{original}"
    if original == "sdpa":
        attention = grouped(attention)
    AttentionInterface.register(name, _per_session(attention))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name
