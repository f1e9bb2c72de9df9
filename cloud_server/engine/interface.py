"""What an engine is: it runs forward jobs over the sessions' KV caches, and nothing else.

An engine knows nothing of sessions, acceptance rules, pacing or gRPC. A session's model work
is written as `Work`: a generator that yields the `ForwardJob`s it needs and returns its
result, so that the batcher can run the jobs of several sessions as one forward while each
session's logic stays sequential (cloud_server/decoding/batching.py). The engines:

- `transformers_engine.ModulesEngine`: transformers' own modules, any causal LM, eager;
- `onnx_engine.OnnxEngine`: the GGUF's 4-bit blocks in one onnxruntime graph (CPU, Llama);
- `static_engine.StaticEngine`: a static-shape torch forward over preallocated KV slots, whose
  buckets are replayed from CUDA graphs on a GPU (Llama, Qwen2, Qwen3, Mistral).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator, Protocol, Sequence, TypeVar

import numpy as np
import torch

T = TypeVar("T")


class KVCache(Protocol):
    """A session's KV cache as the sessions and the drafter's server half read it: its length,
    and per decoder layer `keys` and `values` [1, kv_heads, length, head_dim]."""

    layers: Any

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


@dataclass
class ForwardJob:
    """One session's share of a forward: `ids` appended to `cache` at `positions`.

    Every new token attends to the whole cache and, of the new tokens, to those `seen` [len(ids),
    len(ids)] says (its ancestors in a tree; None: causal, a prompt chunk); `rows` are the new tokens whose logits are wanted; `capture` the decoder
    layers whose outputs to keep. An engine's `run` fills `logits` [len(rows), vocab] and, when
    asked, `hidden` [len(ids), len(capture), width].
    """

    cache: Any  # the engine's KVCache
    ids: tuple[int, ...]
    positions: np.ndarray
    seen: np.ndarray | None
    rows: range
    capture: tuple[int, ...] = ()
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    hidden: torch.Tensor | None = None
    # What its session reads of the logits on the host, filled for every job of a forward at
    # once (TargetModel.run): `greedy` asks each row's argmax into `choices` [len(rows)];
    # `successors_k` each row's k best tokens into `successors` [len(rows), k], best first.
    greedy: bool = False
    choices: np.ndarray | None = None
    successors_k: int = 0
    successors: np.ndarray | None = None


Work = Generator[ForwardJob, None, T]


class Engine(Protocol):
    """Runs forwards of one target model. `batchable`: several sessions' jobs may share a
    forward; `exact_reference`: plain greedy decoding is judged through transformers'
    `generate` on the same modules (else through the engine's own decoding steps)."""

    batchable: bool
    exact_reference: bool

    def describe(self) -> str:
        """One line for the startup log: the engine, its device and precision."""
        ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    def new_cache(self, most_positions: int | None = None) -> Any:
        """An empty KV cache for a session that holds at most `most_positions`."""
        ...

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Gets ready, before the first request, for forwards that capture these sets of
        layers (the static engine captures its CUDA graphs) and hold up to `sessions`
        sessions (the 4-bit engine builds its graphs for them)."""
        ...

    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        """One forward (or as few as the engine can) for all `jobs`; fills their results and
        appends their tokens to their caches. Returns once the results can be read."""
        ...

    def keep_path(self, cache: Any, base: int, accepted_nodes: tuple[int, ...]) -> None:
        """Compacts `cache` after a tree forward to the pending token plus the accepted path:
        it held base + 1 + n entries, entry base + 1 + i belonging to draft node i."""
        ...
