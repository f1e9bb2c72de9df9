"""Sizes of the MoA drafter, read from the target's transformers config; saved as JSON.

The JSON is also what the edge reads from the bundle (edge_client/drafters/moa.py), so it holds
plain numbers only. Defaults follow docs/architecture.md, Drafters: the edge's Self-Attention and
Cross-Attention blocks are each the size of one target layer, and the server's Layer
Self-Attention works at the width of one layer's K and V (2 * kv_heads * head_dim).
`draft_vocab` optionally restricts the draft head to the most frequent tokens of the target's
own answers (docs/architecture.md, Drafters): the head is most of the edge's work and of training's.
`memory` says what the Cross-Attention reads: the target's activations (the MoA drafter), or
the tokens' own embeddings (the paper's "Independent" baseline: the same network, blind to the
target's states, so the pair measures what the activations are worth).
`server_input` says what the server half turns into those activations (`ServerInput`); either
way one row of the target's width travels per verified token, so the edge half is the same.
`block` > 1 makes the same network a semi-autoregressive drafter (Falcon, Gao et al. 2025,
arXiv 2412.12639): a block of `block` tokens that see each other drafts the next `block`
tokens in one step (cloud_server/training/sar.py).
`tli_layers` = N > 0 is the paper's Target Layer Inference (section 3.3): the edge half's output
stands for the target's layer L - N, and the target's own last N layers, frozen, carry it to the
final norm and head (cloud_server/moa/target_layers.py).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from shared.drafter_bundle import Memory

FORMAT_VERSION = 1


class ServerInput(StrEnum):
    """What the server half reads of each verified token (docs/architecture.md, Drafters)."""

    LAYER_KV = "kv"  # per-layer K and V from the KV cache, mixed by Layer Self-Attention (MoA)
    LAST_HIDDEN = "last"  # the last layer's output, before the final norm (EAGLE's feature)
    FUSED_HIDDEN = "fused"  # a low, a middle and the last layer's outputs, fused (EAGLE-3)

    def hidden_layers(self, layers: int) -> tuple[int, ...]:
        """The decoder layers whose outputs this input reads, for a target of `layers`."""
        if self is ServerInput.LAST_HIDDEN:
            return (layers - 1,)
        if self is ServerInput.FUSED_HIDDEN:
            return tuple(sorted({min(2, (layers - 1) // 3), layers // 2, layers - 1}))
        return ()


@dataclass(frozen=True)
class MoaConfig:
    vocab_size: int
    width: int  # the target's hidden size: token embeddings, activations, final norm input
    target_layers: int  # the target's layer count
    lsa_layers: tuple[int, ...]  # target layers whose K/V the LSA reads: its sequence
    target_kv_width: int  # one token's K and V of one layer: 2 * kv_heads * head_dim
    heads: int  # SA and CA query heads
    kv_heads: int  # SA and CA key/value heads (grouped-query attention)
    head_dim: int
    intermediate: int  # SA and CA MLP width
    lsa_heads: int  # LSA heads of head_dim each, over target_kv_width
    lsa_intermediate: int
    rope_theta: float
    rms_eps: float
    draft_vocab: int = 0  # size of the frequency-ranked sub-vocabulary head; 0: the full vocab
    memory: Memory = Memory.ACTIVATIONS  # what the Cross-Attention reads
    server_input: ServerInput = ServerInput.LAYER_KV  # what the server half reads
    hidden_layers: tuple[int, ...] = ()  # decoder layers whose outputs it reads (hidden inputs)
    # each query also reads the previous position's feature: the server's activation where it
    # is verified, else the drafter's own output through the server half (EAGLE's recurrence)
    recurrent: bool = False
    block: int = 1  # tokens drafted per step: 1 the MoA drafter, more Falcon's (module docstring)
    tli_layers: int = 0  # the target's last layers the edge runs after its own (TLI)
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_target(cls, config, intermediate: int | None = None,
                    lsa_intermediate: int | None = None, draft_vocab: int = 0,
                    lsa_stride: int = 1,
                    server_input: ServerInput = ServerInput.LAYER_KV,
                    recurrent: bool = False, block: int = 1,
                    tli_layers: int = 0) -> "MoaConfig":
        """Sizes for a transformers decoder config (hidden_size, num_*_heads, ...).

        The LSA reads every `lsa_stride`-th layer counting down from the last; 1, every layer,
        is the paper's."""
        if lsa_stride < 1:
            raise ValueError(f"lsa_stride is at least 1, not {lsa_stride}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kv_width = 2 * kv_heads * head_dim
        layers = config.num_hidden_layers
        rope = getattr(config, "rope_parameters", None) or {}
        first_type = (getattr(config, "layer_types", None) or [None])[0]
        if first_type in rope:  # per layer type (Gemma 3): the first layer's, which SA starts as
            rope = rope[first_type]
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(vocab_size=config.vocab_size, width=config.hidden_size,
                   target_layers=layers, target_kv_width=kv_width,
                   lsa_layers=tuple(range(layers - 1, -1, -lsa_stride))[::-1],
                   heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=intermediate or config.intermediate_size,
                   lsa_heads=kv_width // head_dim,
                   lsa_intermediate=lsa_intermediate or kv_width,
                   rope_theta=float(theta), rms_eps=float(config.rms_norm_eps),
                   draft_vocab=draft_vocab if 0 < draft_vocab < config.vocab_size else 0,
                   server_input=server_input,
                   hidden_layers=server_input.hidden_layers(layers), recurrent=recurrent,
                   block=block, tli_layers=tli_layers)

    def __post_init__(self) -> None:
        if self.recurrent and (self.server_input is not ServerInput.LAST_HIDDEN
                               or not self.uses_activations):
            raise ValueError("a recurrent drafter reads the last layer's output (server input "
                             "'last'): it feeds its own output back in the same place")
        if self.block < 1:
            raise ValueError(f"a drafter drafts at least one token a step, not {self.block}")
        if self.block > 1 and self.recurrent:
            raise ValueError("a semi-autoregressive (Falcon) drafter reads verified activations "
                             "only: it cannot also be recurrent")
        if not 0 <= self.tli_layers < self.target_layers:
            raise ValueError(f"tli_layers {self.tli_layers}: the target has {self.target_layers} "
                             "layers, so between 0 and one fewer")
        if self.tli_layers and (self.recurrent or self.block > 1):
            raise ValueError("tli_layers: Target Layer Inference runs after a one-token, "
                             "non-recurrent drafter only")
        for name in ("lsa_layers", "hidden_layers"):
            outside = [i for i in getattr(self, name) if not 0 <= i < self.target_layers]
            if outside:
                raise ValueError(f"{name} names layers {outside} that a target of "
                                 f"{self.target_layers} layers lacks")

    def check_target(self, config) -> None:
        """Refuses a transformers config whose sizes are not the ones this drafter was trained
        on, naming the first field that differs."""
        theirs = MoaConfig.from_target(config)
        for name in ("vocab_size", "width", "target_layers", "target_kv_width", "head_dim"):
            if getattr(self, name) != getattr(theirs, name):
                raise ValueError(f"the drafter's {name} is {getattr(self, name)}, the "
                                 f"target's {getattr(theirs, name)}: train a drafter for it")

    @property
    def uses_activations(self) -> bool:
        """Whether the server half runs and the Verdicts carry activations."""
        return self.memory is Memory.ACTIVATIONS

    @property
    def layer_states(self) -> int:
        """Layers whose K/V the edge keeps per position: its Self-Attention's and one per
        target layer it runs (TLI); the step graph's K/V state has kv_heads times as many
        heads (shared/drafter_bundle.py)."""
        return 1 + self.tli_layers

    @property
    def head_size(self) -> int:
        """Rows of the draft head: the sub-vocabulary, or the whole vocabulary."""
        return self.draft_vocab or self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"memory": self.memory.value,
                                           "server_input": self.server_input.value}

    @classmethod
    def from_dict(cls, data: dict) -> "MoaConfig":
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"MoA config format {data.get('format_version')} is not "
                             f"{FORMAT_VERSION}: re-export the drafter")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        memory = fields.get("memory", Memory.ACTIVATIONS.value)
        if memory not in {m.value for m in Memory}:
            raise ValueError(f"unknown drafter memory {memory!r}: one of "
                             f"{', '.join(m.value for m in Memory)}")
        server_input = fields.get("server_input", ServerInput.LAYER_KV.value)
        if server_input not in {s.value for s in ServerInput}:
            raise ValueError(f"unknown server input {server_input!r}: one of "
                             f"{', '.join(s.value for s in ServerInput)}")
        return cls(**fields | {"lsa_layers": tuple(fields["lsa_layers"]),
                               "hidden_layers": tuple(fields.get("hidden_layers", ())),
                               "memory": Memory(memory),
                               "server_input": ServerInput(server_input)})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "MoaConfig":
        return cls.from_dict(json.loads(path.read_text()))
