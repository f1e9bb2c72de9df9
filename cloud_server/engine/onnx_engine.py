"""Runs the target's forwards through onnxruntime with 4-bit weights (`cloud-server --weights
q4`): TargetModel hands it the same ForwardJobs it would run through transformers.

On the CPU a decoding step costs the weight bytes it reads: the GGUF's 4-bit blocks instead of
their fp32 dequantization, and one graph per forward instead of a Python call per module
(onnx_llama.py). The caches stay the sessions' DynamicCaches, growing in place (kv_cache.py), with
the values in double (onnx_llama.KV_TYPES): the graph reads each layer's buffer where it lies and
returns the new keys and values, which are appended here, so compaction, crops and admission
work on them as before.

Lossless against itself: split decoding is judged against plain decoding through this same
engine (cloud_server/reference.py). A row's result does not depend on the rows beside it except
through rounding (a one-row product takes another kernel), so a tree forward and a decoding step
agree up to near-ties, as fp32 does (docs/usage.md, `--weights`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort
import torch
from transformers import DynamicCache

from cloud_server.engine import block_weights, onnx_llama
from cloud_server.engine.kv_cache import ReservedLayer, keep_path, whole_cache

# Sessions a graph takes: a batch runs on the smallest that holds it, padded with one-token
# sessions whose results are dropped; a larger one runs as several forwards. A graph is built
# when first needed (seconds, more for more sessions; results log, `graph_build`), so few sizes
# mean few such stalls, or at startup (`--batch-graphs start`, OnnxEngine.prepare).
BUCKETS = (1, 2, 4, 8)
MOST_SESSIONS = BUCKETS[-1]
NEG = np.float32(np.finfo(np.float32).min)


def shape_of(config: Any) -> onnx_llama.LlamaShape:
    heads = config.num_attention_heads
    return onnx_llama.LlamaShape(
        layers=config.num_hidden_layers, width=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, vocab=config.vocab_size,
        eps=float(config.rms_norm_eps))


def unsupported(model: Any) -> str | None:
    """Why the 4-bit engine cannot run `model` exactly, or None when it can."""
    config = model.config
    if config.model_type != "llama":
        return f"it runs Llama-shaped models only, not {config.model_type!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "it has no biases on the projections"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"it has no {config.hidden_act} activation"
    if config.hidden_size % block_weights.BLOCK or config.intermediate_size % block_weights.BLOCK:
        return f"its layers' widths must be multiples of {block_weights.BLOCK}"
    return None


def llama_weights(model: Any, gguf: Path | None) -> onnx_llama.LlamaWeights:
    """The model's weights for the graph: its GGUF's blocks as shipped when there is one, else its
    fp32 linear layers rounded to 4 bits."""
    state = {name: p.detach().float().numpy() for name, p in model.state_dict().items()}
    shape = shape_of(model.config)
    if gguf is not None:
        blocks = block_weights.from_gguf(gguf, shape.heads, shape.kv_heads)
    else:
        blocks = {name[: -len(".weight")]: block_weights.quantize_q4(w)
                  for name, w in state.items() if w.ndim == 2 and "embed_tokens" not in name}
        blocks.setdefault("lm_head", block_weights.quantize_q4(
            state["model.embed_tokens.weight"]))
    norms = {name[: -len(".weight")]: w for name, w in state.items() if "norm" in name}
    rotary = model.model.rotary_emb
    return onnx_llama.LlamaWeights(blocks, norms, rotary.inv_freq.float().numpy(),
                                   float(getattr(rotary, "attention_scaling", 1.0)))


class OnnxEngine:
    """Forwards of up to MOST_SESSIONS sessions a graph; one graph per session count, built
    when first needed."""

    batchable = True
    exact_reference = False

    def __init__(self, config: Any, weights: onnx_llama.LlamaWeights,
                 embedding: torch.nn.Module, threads: int,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        self._config = config
        self.shape = shape_of(config)
        self._weights = weights
        # looked up in numpy: a torch op would wake torch's threads between two runs
        table = embedding.weight
        assert isinstance(table, torch.Tensor)
        self._table = table.detach().float().numpy()
        self._threads, self._level = threads, level
        self._consts: dict[str, Any] = {}
        self._graphs: dict[int, ort.InferenceSession] = {}

    def _graph(self, sessions: int) -> ort.InferenceSession:
        if sessions not in self._graphs:
            options = ort.SessionOptions()
            options.intra_op_num_threads = self._threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = self._level
            if self._graphs:
                print(f"building the 4-bit graph for {sessions} sessions a forward (once)",
                      file=sys.stderr, flush=True)
            model = onnx_llama.build(self.shape, self._weights, sessions, self._consts)
            self._graphs[sessions] = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return self._graphs[sessions]

    def describe(self) -> str:
        return "4-bit onnxruntime engine (q4)"

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer's KV heads: keys in fp32, values in double (KV_TYPES)."""
        s = self.shape
        return s.layers * s.kv_heads * s.head_dim * (4 + 8)

    def new_cache(self, most_positions: int | None = None) -> DynamicCache:
        return whole_cache(self._config, True, most_positions)

    def keep_path(self, cache: DynamicCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
        keep_path(cache, base, accepted_nodes)

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Builds the graphs for up to `sessions` sessions a forward now, rather than when a
        batch first needs one while every session waits (results log, `graph_build`); each
        graph outputs every layer, so `captures` needs nothing."""
        for size in BUCKETS:
            self._graph(size)
            if size >= sessions:
                break

    def warm_up(self) -> None:
        """Builds the one-session graph now rather than in the first request's forward."""
        self._graph(1)

    @torch.inference_mode()
    def run(self, jobs: Sequence[Any], capture: tuple[int, ...]) -> None:
        """Fills each job's logits (and hidden states for `capture`); appends the new keys
        and values to its cache."""
        for start in range(0, len(jobs), MOST_SESSIONS):
            self._run(jobs[start: start + MOST_SESSIONS], capture)

    def _run(self, jobs: Sequence[Any], capture: tuple[int, ...]) -> None:
        s = self.shape
        sessions = next(size for size in BUCKETS if size >= len(jobs))
        padded = [*jobs, *[PAD] * (sessions - len(jobs))]
        lengths = [len(job.ids) for job in padded]
        # A one-row product takes another kernel, which rounds differently; a lone token runs
        # beside a copy of itself, so a decoding step computes what a tree forward does.
        twin = lengths == [1]
        offsets = np.cumsum([0] + lengths)
        ids = np.array([t for job in padded for t in job.ids] * (1 + twin))
        feed: dict[str, np.ndarray] = {
            "embeds": self._table[ids],
            "positions": np.concatenate([job.positions for job in padded] * (1 + twin)),
            "keep": np.concatenate([o + np.array(job.rows, dtype=np.int64)
                                    for o, job in zip(offsets, padded)])}
        if sessions > 1:
            feed["lengths"] = np.array(lengths, dtype=np.int64)
        for b, job in enumerate(padded):
            feed.update(self._session_inputs(job, b, twin))
        names = (["logits"] + [f"new_{kv}_{i}" for i in range(s.layers) for kv in "kv"]
                 + [f"hidden_{i}" for i in capture])
        out = dict(zip(names, self._graph(sessions).run(names, feed)))
        real = offsets[len(jobs)]  # the rows of the jobs, before the padding
        logits = torch.from_numpy(out["logits"]).split([len(job.rows) for job in jobs])
        hidden = (torch.from_numpy(np.stack([out[f"hidden_{i}"][:real] for i in capture],
                                            axis=1)).split(lengths[: len(jobs)])
                  if capture else None)
        for b, job in enumerate(jobs):
            job.logits = logits[b]
            job.hidden = hidden[b] if hidden is not None and job.capture else None
        spans = list(zip(offsets[: len(jobs)], offsets[1: len(jobs) + 1]))
        for i in range(s.layers):
            keys, values = out[f"new_k_{i}"], out[f"new_v_{i}"]
            for job, (start, end) in zip(jobs, spans):
                _append(job.cache, i, keys[:, start:end], values[:, start:end])

    def _session_inputs(self, job: Any, b: int, twin: bool) -> dict[str, np.ndarray]:
        """Session b's mask [groups * new, room + new], its split of the scores, and its
        layers' cache buffers [kv_heads, room, head_dim] as they lie. `twin`: its one token
        runs twice, the copy seeing what the token sees."""
        s = self.shape
        pasts = [_buffers(job.cache, i, s) for i in range(s.layers)]
        cached = 0 if job.cache is None else job.cache.get_seq_length()
        room, new = pasts[0][0].shape[1], len(job.ids)
        seen = np.tri(new, dtype=bool) if job.seen is None else job.seen  # [new, new]
        mask = np.full((new + twin, room + new + twin), NEG, dtype=np.float32)
        mask[:new, :cached] = 0
        mask[:new, room: room + new][seen] = 0
        mask[new:] = mask[:twin]
        feed = {f"mask_{b}": np.tile(mask, (s.groups, 1)),
                f"parts_{b}": np.array([room, new + twin], dtype=np.int64)}
        for i, (keys, values) in enumerate(pasts):
            feed[f"past_k_{i}_{b}"], feed[f"past_v_{i}_{b}"] = keys, values
        return feed


def _append(cache: DynamicCache, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
    """Appends a layer's new keys and values [kv_heads, n, head_dim] to a session's cache."""
    entry = cache.layers[layer]
    if isinstance(entry, ReservedLayer):
        entry.append(keys, values)
    else:
        cache.update(torch.from_numpy(keys)[None], torch.from_numpy(values)[None], layer)


@dataclass(frozen=True)
class _Padding:
    """A one-token session with nothing cached that fills a graph's unused session slot."""

    ids: tuple[int, ...] = (0,)
    positions: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    rows: tuple[int, ...] = ()
    seen: None = None
    cache: None = None


PAD = _Padding()


def _buffers(cache: DynamicCache | None, layer: int, s: onnx_llama.LlamaShape
             ) -> tuple[np.ndarray, np.ndarray]:
    """A layer's keys (fp32) and values (double) [kv_heads, room, head_dim], without copying
    where it can; empty for a padding session."""
    entry = None if cache is None else cache.layers[layer]
    stored = entry.arrays() if isinstance(entry, ReservedLayer) else None
    if stored is not None:
        return stored
    keys, values = getattr(entry, "keys", None), getattr(entry, "values", None)
    if cache is None or keys is None or values is None or not cache.get_seq_length(layer):
        return (np.zeros((s.kv_heads, 0, s.head_dim), dtype=np.float32),
                np.zeros((s.kv_heads, 0, s.head_dim), dtype=np.float64))
    return keys[0].contiguous().numpy(), values[0].contiguous().numpy()
