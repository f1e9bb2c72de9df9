"""The trained drafter's network on the edge: the bundle's two ONNX graphs and one generation's
state, run with onnxruntime.

Zimmer et al., arXiv 2410.03804, split per docs/architecture.md, Drafters: the server sends the
activations of verified positions (`add_activations`); the memory graph turns them into the
Cross-Attention K/V kept here, and the step graph runs tokens against that memory and the
Self-Attention K/V of the committed text, also kept here. A bundle whose memory is the tokens'
embeddings (the paper's Independent baseline) needs no activations: it feeds its memory from
the committed text itself, up to the same verified boundary (`ready`).

Which tokens a step runs, one at a time or Falcon's blocks, and the trees drafted from the
rows are the drafters' (moa.py, falcon.py, tree_drafter.py). Numpy and onnxruntime only.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import numpy as np

from edge_client.drafters.draft_trees import common_prefix
from edge_client.drafters.moa_bundle import load_manifest
from shared.drafter_bundle import BundleError, Graph, Memory, MemoryIO, Precision, StepIO
from shared.drafting.base import DrafterName


class MoaGraphs:
    """The memory and step graphs over one generation's K/V: the sessions are loaded once and
    shared by `sibling`s, each with state of its own."""

    def __init__(self, bundle_dir: Path, precision: Precision | None = None,
                 threads: int = 1) -> None:
        import onnxruntime as ort

        manifest = load_manifest(bundle_dir)
        config = manifest.config
        self.block = manifest.block  # tokens a step sees each other in: > 1 for Falcon
        self.kv_heads, self.head_dim = config["kv_heads"], config["head_dim"]
        # heads of the K/V state kept per position: the Self-Attention's, then each TLI layer's
        self.state_heads = manifest.state_heads
        self.width, self.vocab = config["width"], config["vocab_size"]
        self.top_k = manifest.top_k  # the step graph's candidates per row
        self.memory = manifest.memory
        self.needs_activations = self.memory is Memory.ACTIVATIONS
        self.recurrent = manifest.recurrent
        self.step_calls = 0  # step graph runs so far (benchmarks/moa_tau.py: steps per round)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.precision = precision or manifest.preferred
        try:
            self._memory, self._step = (
                ort.InferenceSession(str(bundle_dir / manifest.graph(self.precision, graph)),
                                     options, providers=["CPUExecutionProvider"])
                for graph in (Graph.MEMORY, Graph.STEP))
        except Exception as err:  # onnxruntime's own (Fail, InvalidGraph, ...): no common base
            raise BundleError(f"onnxruntime {ort.__version__} cannot load the drafter's "
                              f"{self.precision.value} graphs ({str(err).splitlines()[0]}): "
                              "update onnxruntime") from None
        self.reset()

    @property
    def kind(self) -> DrafterName:
        """The drafter the bundle was trained for."""
        return DrafterName.FALCON if self.block > 1 else DrafterName.MOA

    def sibling(self) -> "MoaGraphs":
        """State of its own over these sessions: onnxruntime runs one session from several
        threads at once."""
        twin = copy.copy(self)
        twin.step_calls = 0
        twin.reset()
        return twin

    def reset(self) -> None:
        """Forgets the text and the activation memory."""
        self.context: list[int] = []  # committed ids whose SA K/V are cached
        self.keys, self.values = self.empty(), self.empty()  # [state_heads, len(context), hd]
        # [kv_heads, verified, hd] each; every change makes new arrays
        self._mem_keys = self._mem_values = np.zeros((self.kv_heads, 0, self.head_dim),
                                                     dtype=np.float32)
        self._mem_ids: list[int] = []  # the tokens in the memory, without activations
        # recurrent: the verified activations, the features of those positions
        self.rows = np.zeros((0, self.width), dtype=np.float32)  # [verified, width]

    def empty(self) -> np.ndarray:
        """K/V of no positions: [state_heads, 0, hd]."""
        return np.zeros((self.state_heads, 0, self.head_dim), dtype=np.float32)

    @property
    def verified(self) -> int:
        """How many leading positions have activations in the memory."""
        return self._mem_keys.shape[1]

    def add_activations(self, start: int, activations: np.ndarray) -> None:
        """Activations of committed positions start .. start + n - 1: [n, width], any float
        dtype. `start` below `verified` rewinds the memory there first (a resumed session)."""
        if not self.needs_activations:
            raise ValueError("this drafter reads no activations: its memory is the text's tokens")
        if start > self.verified:
            raise ValueError(f"activations start at {start}, but only {self.verified} "
                             "positions are verified: one verdict's activations are missing")
        if activations.ndim != 2 or activations.shape[1] != self.width:
            raise ValueError(f"activations must be [n, {self.width}], got {activations.shape}")
        rows = np.ascontiguousarray(activations, dtype=np.float32)
        self._remember(start, rows)
        if self.recurrent:
            self.rows = np.concatenate((self.rows[:start], rows))

    def ready(self, context: Sequence[int]) -> bool:
        """Brings a self-fed memory up to `context`; whether any position is verified."""
        if not self.needs_activations:
            self._remember_tokens(context)
        return self.verified > 0

    def keep(self, length: int) -> None:
        """Keeps the SA K/V of the text's first `length` positions only (a rewind)."""
        self.context = self.context[:length]
        self.keys, self.values = self.keys[:, :length], self.values[:, :length]

    def append(self, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray) -> None:
        """Caches the SA K/V ([state_heads, len(tokens), hd] each) of `tokens` after the text."""
        self.context += tokens
        self.keys = np.concatenate((self.keys, keys), axis=1)
        self.values = np.concatenate((self.values, values), axis=1)

    def step(self, ids: np.ndarray, positions: np.ndarray, allowed: np.ndarray,
             tree: tuple[np.ndarray, np.ndarray] | None = None,
             features: np.ndarray | None = None) -> list[np.ndarray]:
        """The step graph (shared/drafter_bundle.py StepIO) for `ids` [q] at `positions` [q]
        after the cached text and, in a round, `tree`: the K/V of the nodes it ran
        ([state_heads, slots, hd] each); `allowed` [q, past + q] is the mask over those and
        the queries; `features` [q, width] for a recurrent drafter."""
        keys, values = self.keys, self.values
        if tree is not None:
            keys = np.concatenate((keys, tree[0]), axis=1)
            values = np.concatenate((values, tree[1]), axis=1)
        inputs = (ids, positions, keys, values, allowed, self._mem_keys,
                  self._mem_values) + ((features,) if self.recurrent else ())
        self.step_calls += 1
        return self._step_run(dict(zip(StepIO.inputs(self.recurrent), inputs)))

    def _step_run(self, feed: dict[str, np.ndarray | None]) -> list[np.ndarray]:
        """The step graph on `feed` (benchmarks/bundle_fidelity.py records what it is fed)."""
        return self._step.run(None, feed)

    def _remember(self, start: int, rows: np.ndarray) -> None:
        """Keeps memory positions < start and appends the K/V of `rows` after them."""
        keys, values = self._memory.run(None, {
            MemoryIO.rows(self.memory): rows,
            MemoryIO.POSITIONS: np.arange(start, start + len(rows), dtype=np.int64)})
        self._mem_keys = np.concatenate((self._mem_keys[:, :start], keys), axis=1)
        self._mem_values = np.concatenate((self._mem_values[:, :start], values), axis=1)

    def _remember_tokens(self, context: Sequence[int]) -> None:
        """Self-fed memory: every committed token but the last, as activations would cover."""
        verified = list(context[:-1])
        keep = common_prefix(self._mem_ids, verified)
        if keep < len(verified) or keep < len(self._mem_ids):
            self._remember(keep, np.asarray(verified[keep:], dtype=np.int64))
            self._mem_ids = verified
