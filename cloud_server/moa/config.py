"""Sizes of the MoA drafter, read from the target's transformers config; saved as JSON.

The JSON is also what the edge reads from the bundle (edge_client/drafters/moa.py), so it holds
plain numbers only. Defaults follow DESIGN section 3.1: the edge's Self-Attention and
Cross-Attention blocks are each the size of one target layer, and the server's Layer
Self-Attention works at the width of one layer's K and V (2 * kv_heads * head_dim).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1


@dataclass(frozen=True)
class MoaConfig:
    vocab_size: int
    width: int  # the target's hidden size: token embeddings, activations, final norm input
    target_layers: int  # LSA sequence length: one entry per target layer
    target_kv_width: int  # one token's K and V of one layer: 2 * kv_heads * head_dim
    heads: int  # SA and CA query heads
    kv_heads: int  # SA and CA key/value heads (grouped-query attention)
    head_dim: int
    intermediate: int  # SA and CA MLP width
    lsa_heads: int  # LSA heads of head_dim each, over target_kv_width
    lsa_intermediate: int
    rope_theta: float
    rms_eps: float
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_target(cls, config, intermediate: int | None = None,
                    lsa_intermediate: int | None = None) -> "MoaConfig":
        """Sizes for any Llama-like transformers config (hidden_size, num_*_heads, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kv_width = 2 * kv_heads * head_dim
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(vocab_size=config.vocab_size, width=config.hidden_size,
                   target_layers=config.num_hidden_layers, target_kv_width=kv_width,
                   heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=intermediate or config.intermediate_size,
                   lsa_heads=kv_width // head_dim,
                   lsa_intermediate=lsa_intermediate or 2 * kv_width,
                   rope_theta=float(theta), rms_eps=float(config.rms_norm_eps))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MoaConfig":
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"MoA config format {data.get('format_version')} is not "
                             f"{FORMAT_VERSION}: re-export the drafter")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "MoaConfig":
        return cls.from_dict(json.loads(path.read_text()))
