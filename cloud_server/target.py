"""The target model: token ids in, logits out, with a KV cache per session.

Knows nothing of sessions, acceptance rules or gRPC. A draft tree is verified in one forward
pass: the pending token (committed but not yet in the cache) followed by the tree's nodes, under
a 4D ancestor mask with positions = base + depth (docs/architecture.md, Verification; SpecInfer, Miao et al. 2024,
section 4.2). Works for the families self_check.py lists; another architecture loads only if it
passes that module's check at startup.

Model work is written as `Work`: a generator that yields the `ForwardJob`s it needs and returns
its result, so that the forwards of several sessions can run as one (`run`, ragged.py) while
each session's logic stays sequential. `drive` runs one piece of work alone.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generator, Sequence, TypeVar

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase,
)

from cloud_server import ragged
from cloud_server.cpu_kernels import use_onednn_linear
from cloud_server.device import Device, Precision, Weights
from cloud_server.kv_cache import whole_cache
from cloud_server.layer_outputs import LayerOutputs
from cloud_server.self_check import check_target
from cloud_server.session_mask import SessionMask, sliding_window
from shared.errors import InvalidRequest
from shared.messages import ChatMessage
from shared.tree import DraftTree


if TYPE_CHECKING:
    from cloud_server.onnx_engine import OnnxEngine

T = TypeVar("T")
PREFILL_CHUNK = 256  # prompt tokens per forward: a long prompt does not hold a batch up


@dataclass
class ForwardJob:
    """One session's share of a forward: `ids` appended to `cache` at `positions`.

    `allowed` [len(ids), cached + len(ids)] says what each new token attends to (None: causal,
    a prompt chunk); `rows` are the new tokens whose logits are wanted; `capture` the decoder
    layers whose outputs to keep. `run` fills `logits` [len(rows), vocab] and, when asked,
    `hidden` [len(ids), len(capture), width].
    """

    cache: DynamicCache
    ids: tuple[int, ...]
    positions: np.ndarray
    allowed: np.ndarray | None
    rows: range
    capture: tuple[int, ...] = ()
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    hidden: torch.Tensor | None = None


Work = Generator[ForwardJob, None, T]


def pick_device(device: Device) -> torch.device:
    if device is Device.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is Device.CUDA and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(device.value)


def pick_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    if precision is Precision.AUTO:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
            Precision.FP16: torch.float16}[precision]


@dataclass
class TargetModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: torch.device
    batchable: bool = False  # several sessions' jobs can share a forward (ragged.py)
    engine: "OnnxEngine | None" = None  # runs the forwards instead of `model` (--weights q4)

    @classmethod
    def load(cls, path: str, model_id: str, device: Device | str = Device.AUTO,
             onednn: bool = True, precision: Precision | str = Precision.FP32,
             weights: Weights | str = Weights.FP32, gguf: Path | None = None) -> "TargetModel":
        """`device`, `precision` and `weights` may be given as text ("cpu", "bf16", "q4");
        `onednn`: on the CPU, run fp32 linear layers through oneDNN (cpu_kernels.py). fp32 by
        default, as `cloud-server --dtype`: only there is greedy output plain decoding's token
        for token on a GPU too (README, `--dtype`). `gguf`: the file the checkpoint was
        converted from, whose 4-bit blocks `weights` q4 runs as they ship."""
        dev = pick_device(Device(device))
        dtype = pick_dtype(Precision(precision), dev)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        # transformers wraps PreTrainedModel.to in a decorator whose stub loses the signature
        model = model.to(dev).eval()  # type: ignore[arg-type]
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = _engine(model, Weights(weights), gguf)
        if engine is None and onednn and dev.type == "cpu":
            use_onednn_linear(model)
        batchable = engine is not None or ragged.install(model)
        if not batchable and sliding_window(model.config) is not None:
            raise ValueError(f"{model_id}: its sliding-window layers need transformers' "
                             f"attention interface, which "
                             f"{model.config._attn_implementation!r} attention does not go "
                             f"through")
        target = cls(model, tokenizer, model_id, dev, batchable, engine)
        check_target(target)
        return target

    @property
    def window(self) -> int | None:
        """The target's sliding window, None when every layer attends to all it has."""
        return sliding_window(self.model.config)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position costs in the KV cache: K and V of every layer's KV heads."""
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        element = next(self.model.parameters()).element_size()
        pair = 4 + 8 if self.engine is not None else 2 * element  # the engine's values: double
        return c.num_hidden_layers * heads * head_dim * pair

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)

    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(sorted(int(i) for i in ids if i is not None))

    def tokenizer_json(self) -> bytes:
        """The tokenizer in the `tokenizers` library format, for the edge."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise RuntimeError(f"{self.model_id} has no fast tokenizer to send to the edge")
        return backend.to_str().encode()

    def apply_chat_template(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"{self.model_id} has no chat template: send input_ids instead")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def new_cache(self, most_positions: int | None = None) -> DynamicCache:
        """An empty cache. On the CPU it grows in place (kv_cache.py), to at most
        `most_positions` of room when given. On a GPU, transformers' concatenating cache: the
        forward there is bound by the host, and in place cost 1-4% a forward on an H100
        (`benchmarks/results/kv_growth_gpu.md`) where on the CPU it saved up to 25%."""
        return whole_cache(self.model.config, self.device.type == "cpu", most_positions)

    def prefill_jobs(self, cache: DynamicCache, ids: Sequence[int], capture: tuple[int, ...] = ()
                     ) -> Work[tuple[torch.Tensor, torch.Tensor | None]]:
        """Appends `ids` to `cache` in chunks of PREFILL_CHUNK; returns the logits after the
        last one [vocab] and, when asked, the captured layer outputs [len(ids), L, width]."""
        if not ids:
            raise ValueError("nothing to prefill")
        hidden = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = tuple(ids[start: start + PREFILL_CHUNK])
            last = start + len(chunk) == len(ids)
            job = ForwardJob(cache, chunk, cache.get_seq_length() + np.arange(len(chunk)), None,
                             range(len(chunk) - 1, len(chunk)) if last else range(0), capture)
            yield job
            if job.hidden is not None:
                hidden.append(job.hidden)
        return job.logits[-1], torch.cat(hidden) if hidden else None

    def tree_job(self, cache: DynamicCache, pending: int, tree: DraftTree,
                 capture: tuple[int, ...] = ()) -> ForwardJob:
        """[pending] + tree appended to the cache; row 0 of its logits is the target after the
        committed text, row i + 1 after draft node i."""
        base = cache.get_seq_length()
        n = len(tree)
        allowed = np.zeros((1 + n, base + 1 + n), dtype=bool)
        allowed[:, : base + 1] = True
        allowed[1:, base + 1:] = tree.ancestor_mask()
        positions = base + np.concatenate(([0], 1 + tree.depths()))
        return ForwardJob(cache, (pending, *tree.tokens), positions, allowed, range(1 + n),
                          capture)

    def drive(self, work: Work[T]) -> T:
        """Runs `work` with forwards of its own."""
        try:
            while True:
                self.run([next(work)])
        except StopIteration as done:
            return done.value

    def prefill(self, prompt_ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """Runs the prompt; returns its cache and the logits after the last token: [vocab]."""
        cache = self.new_cache()
        return cache, self.drive(self.prefill_jobs(cache, prompt_ids))[0]

    def forward_tree(self, cache: DynamicCache, pending: int, tree: DraftTree) -> torch.Tensor:
        """Appends [pending] + tree to the cache; returns logits: [1 + n, vocab]."""
        job = self.tree_job(cache, pending, tree)
        self.run([job])
        return job.logits

    @torch.inference_mode()
    def run(self, jobs: Sequence[ForwardJob]) -> None:
        """One forward for all `jobs` (ragged when there are several); fills their results."""
        if len(jobs) > 1 and not self.batchable:
            raise RuntimeError(f"{self.model_id} cannot run several sessions in one forward")
        layers = next((job.capture for job in jobs if job.capture), ())
        if self.engine is not None:
            self.engine.run(jobs, layers)
            return
        offsets = np.cumsum([0] + [len(job.ids) for job in jobs])
        keep = np.concatenate([start + np.array(job.rows, dtype=np.int64)
                               for start, job in zip(offsets, jobs)])
        with LayerOutputs(self.model, layers) if layers else nullcontext() as captured:
            cache, mask = self._cache_and_mask(jobs)
            out = self.model(
                input_ids=torch.tensor([[t for job in jobs for t in job.ids]],
                                       device=self.device),
                attention_mask=mask,
                position_ids=torch.as_tensor(np.concatenate([job.positions for job in jobs]),
                                             device=self.device)[None],
                past_key_values=cache, use_cache=True,
                logits_to_keep=torch.as_tensor(keep, device=self.device))
        logits = out.logits[0].float().split([len(job.rows) for job in jobs])
        hidden = None if captured is None else captured.stacked()[0].split(
            [len(job.ids) for job in jobs])
        for i, job in enumerate(jobs):
            job.logits = logits[i]
            job.hidden = hidden[i] if hidden is not None and job.capture else None
        self.synchronize()

    def synchronize(self) -> None:
        """Waits for the device to finish what was launched: a CUDA forward returns before
        it has run, and a clock read right after would time the launch only."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _cache_and_mask(self, jobs: Sequence[ForwardJob]
                        ) -> tuple[DynamicCache | ragged.RaggedCache, torch.Tensor | None]:
        if len(jobs) == 1 and self.window is None:  # the model's own path and masks
            job = jobs[0]
            return job.cache, None if job.allowed is None else self._additive(job.allowed)
        masks = [self._session_mask(job) for job in jobs]
        return (ragged.RaggedCache([job.cache for job in jobs], [len(job.ids) for job in jobs],
                                   masks),
                ragged.PLACEHOLDER_MASK.to(self.device))

    def _session_mask(self, job: ForwardJob) -> SessionMask:
        cached = job.cache.get_seq_length()
        queries = torch.as_tensor(job.positions, device=self.device)
        keys = torch.cat([torch.arange(cached, device=self.device), queries])
        return SessionMask(self._additive(self._allowed(job)), queries, keys)

    @staticmethod
    def _allowed(job: ForwardJob) -> np.ndarray:
        if job.allowed is not None:
            return job.allowed
        new, cached = len(job.ids), job.cache.get_seq_length()
        return np.tri(new, cached + new, cached, dtype=bool)

    def _additive(self, allowed: np.ndarray) -> torch.Tensor:
        """The additive form of a boolean mask: [1, 1, new, cached + new]."""
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(torch.from_numpy(~allowed).to(self.device), torch.finfo(dtype).min)
        return mask[None, None]


def _engine(model: PreTrainedModel, weights: Weights, gguf: Path | None) -> "OnnxEngine | None":
    """The 4-bit engine for `model` when `weights` asks for it (auto: where it can run)."""
    if weights is Weights.FP32:
        return None
    from cloud_server import onnx_engine

    why = onnx_engine.unsupported(model)
    if model.device.type != "cpu" or model.dtype != torch.float32:
        why = why or "it runs on the CPU from fp32 weights only (--device cpu --dtype fp32)"
    if why is not None:
        if weights is Weights.Q4:
            raise ValueError(f"--weights q4 cannot run this model: {why}")
        return None
    engine = onnx_engine.OnnxEngine(onnx_engine.shape_of(model.config),
                                    onnx_engine.llama_weights(model, gguf),
                                    model.get_input_embeddings(), torch.get_num_threads())
    engine.warm_up()
    return engine


@torch.inference_mode()
def keep_path(cache: DynamicCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
    """Compacts the cache after a tree forward to the pending token plus the accepted path.

    The cache holds base + 1 + n entries; entry base + 1 + i belongs to draft node i. The
    accepted nodes move down to base + 1, base + 2, ... and everything after them is dropped.
    """
    new_len = base + 1 + len(accepted_nodes)
    if not accepted_nodes and cache.get_seq_length() == new_len:
        return  # a decoding step: nothing to move or drop
    src = torch.tensor([base + 1 + i for i in accepted_nodes], dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window KV layers cannot be compacted yet")
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [batch, kv_heads, seq, head_dim]
            if len(src):
                states[:, :, base + 1: new_len] = states[:, :, src.to(states.device)]
            setattr(layer, name, states[:, :, :new_len])
