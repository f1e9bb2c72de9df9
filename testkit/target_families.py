"""Tiny random-weight checkpoints of the model families operators serve, each with what sets
it apart from Llama switched on: biases on q/k/v (Qwen2), q/k norms (Qwen3), sliding-window
layers (Mistral, Qwen2 with use_sliding_window, Gemma 2 and 3), soft-capping, pre/post norms and
a scaled embedding (Gemma 2), fused qkv and gate_up projections (Phi-3), llama3 rope scaling and
an untied head (Llama 3). Built in the test, no download."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from testkit.tiny_model import save_sharpened

WINDOW = 8  # sliding window of the tiny checkpoints: prompts in the tests run past it
COMMON: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("Llama", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen2-sliding": ("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=1)),
    "qwen3": ("Qwen3", dict(head_dim=32)),
    "mistral": ("Mistral", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                              final_logit_softcapping=2.0)),  # within the tiny logits' range
    "gemma3": ("Gemma3Text", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)),
    "phi3": ("Phi3", dict(sliding_window=WINDOW)),
}


# Architectures outside the verified table (cloud_server/self_check.py): one the generic path
# runs exactly, one it cannot (ALiBi, built from a 2D padding mask).
OUTSIDE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4)),
}


def build_family(name: str, path: Path, seed: int = 0) -> Path:
    """Writes the tiny checkpoint of family `name` (FAMILIES or OUTSIDE) and a byte-level
    tokenizer to `path`."""
    if name in OUTSIDE:
        config_class, model_class, overrides = OUTSIDE[name]
    else:
        prefix, overrides = FAMILIES[name]
        config_class = f"{prefix}Config"
        model_class = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    config = getattr(transformers, config_class)(**COMMON, **overrides)
    torch.manual_seed(seed)
    return save_sharpened(getattr(transformers, model_class)(config), path)
