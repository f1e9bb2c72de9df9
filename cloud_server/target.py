"""The target model as the sessions see it: its tokenizer, its stop tokens, and the forward
jobs a prompt or a draft tree needs, run by whichever engine loaded it (cloud_server/engine/).

Knows nothing of sessions, acceptance rules or gRPC. A draft tree is verified in one forward
pass: the pending token (committed but not yet in the cache) followed by the tree's nodes, under
an ancestor mask with positions = base + depth (docs/architecture.md, Verification; SpecInfer,
Miao et al. 2024, section 4.2). Works for the families self_check.py lists; another
architecture loads only if it passes that module's check at startup. `drive` runs one piece of
model work (engine/interface.py, `Work`) alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from cloud_server.device import Device, EngineChoice, Graphs, Precision, Weights
from cloud_server.engine.choice import pick_engine
from cloud_server.engine.interface import Engine, ForwardJob, Work
from cloud_server.engine.session_mask import sliding_window
from cloud_server.engine.static_engine import SlotPlan
from cloud_server.engine.tensor_parallel import unfit
from cloud_server.self_check import check_target
from shared.errors import InvalidRequest
from shared.messages import ChatMessage, Limits
from shared.tree import DraftTree

T = TypeVar("T")
PREFILL_CHUNK = 256  # prompt tokens per forward: a long prompt does not hold a batch up
SLOT_TEXT_FLOOR = 128  # text positions a KV slot holds at least (the startup calibration's)


def pick_device(device: Device) -> torch.device:
    if device is Device.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is Device.CUDA and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(device.value)


def ranks_unfit(path: str, ranks: int, device: Device) -> str | None:
    """Why `ranks` cannot split the checkpoint at `path` on `device`, naming the counts that
    can (engine/tensor_parallel.py); None when they can. Reads the config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    on_cuda = pick_device(device).type == "cuda"
    return unfit(config, ranks, torch.cuda.device_count() if on_cuda else None)


def pick_dtype(precision: Precision, device: torch.device, path: str) -> torch.dtype:
    """auto: bf16 on a GPU; on the CPU the checkpoint's bf16, else fp32 (an fp16 matmul on a
    CPU is slow and a checkpoint's fp32 is kept)."""
    if precision is Precision.AUTO:
        if device.type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if checkpoint_dtype(path) == "bfloat16" else torch.float32
    return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
            Precision.FP16: torch.float16}[precision]


def checkpoint_dtype(path: str) -> str | None:
    """The dtype a checkpoint's config names, if any."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if named is None else str(named).removeprefix("torch.")


@dataclass
class TargetModel:
    model: PreTrainedModel  # the loaded modules (the static engine runs on their weights)
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: torch.device
    engine: Engine

    @classmethod
    def load(cls, path: str, model_id: str, device: Device | str = Device.AUTO,
             onednn: bool = True, precision: Precision | str = Precision.FP32,
             weights: Weights | str = Weights.FP32, gguf: Path | None = None,
             engine: EngineChoice | str = EngineChoice.AUTO, graphs: Graphs | str = Graphs.AUTO,
             limits: Limits = Limits(), ranks: int = 1,
             on_rank_lost: Callable[[str], None] | None = None) -> "TargetModel":
        """`device`, `precision`, `weights`, `engine` and `graphs` may be given as text
        ("cpu", "bf16", "q4", "static", "off"); `onednn`: on the CPU, run fp32 linear layers
        through oneDNN (cpu_kernels.py). `gguf`: the file the checkpoint was converted from,
        whose 4-bit blocks `weights` q4 runs as they ship. `limits` size the static engine's
        KV slots. fp32 by default here (the tests' equivalence is exact only there);
        `cloud-server --dtype` defaults to auto. `ranks` > 1: split over that many ranks
        (`--tensor-parallel`; the loaded modules stay on the CPU, for what reads them beside
        the engine), `on_rank_lost` told if one goes (engine/ranks.py)."""
        dev = pick_device(Device(device))
        dtype = pick_dtype(Precision(precision), dev, path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        # transformers wraps PreTrainedModel.to in a decorator whose stub loses the signature
        model = model.to(dev if ranks == 1 else "cpu").eval()  # type: ignore[arg-type]
        tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            chosen = pick_engine(model, dev, Weights(weights), EngineChoice(engine),
                                 Graphs(graphs), slot_plan(limits), gguf, onednn, ranks,
                                 on_rank_lost)
        except ValueError as err:
            raise ValueError(f"{model_id}: {err}") from None
        target = cls(model, tokenizer, model_id, dev, chosen)
        check_target(target)
        return target

    @property
    def batchable(self) -> bool:
        """Several sessions' jobs can share a forward."""
        return self.engine.batchable

    @property
    def window(self) -> int | None:
        """The target's sliding window, None when every layer attends to all it has."""
        return sliding_window(self.model.config)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position costs in the KV cache."""
        return self.engine.kv_bytes_per_token

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

    def new_cache(self, most_positions: int | None = None) -> Any:
        """An empty KV cache of the engine's, for at most `most_positions`."""
        return self.engine.new_cache(most_positions)

    def keep_path(self, cache: Any, base: int, accepted_nodes: tuple[int, ...]) -> None:
        """Compacts `cache` after a tree forward to the pending token plus the accepted path."""
        self.engine.keep_path(cache, base, accepted_nodes)

    def prefill_jobs(self, cache: Any, ids: Sequence[int], capture: tuple[int, ...] = (),
                     asks: Callable[[ForwardJob], ForwardJob] = lambda job: job
                     ) -> Work[tuple[ForwardJob, torch.Tensor | None]]:
        """Appends `ids` to `cache` in chunks of PREFILL_CHUNK; returns the last chunk's job,
        its logits [1, vocab] the row after the last id (`asks` marks what its caller reads of
        them on the host, read_to_host), and, when asked, the captured layer outputs
        [len(ids), L, width]."""
        if not ids:
            raise ValueError("nothing to prefill")
        hidden = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = tuple(ids[start: start + PREFILL_CHUNK])
            last = start + len(chunk) == len(ids)
            job = ForwardJob(cache, chunk, cache.get_seq_length() + np.arange(len(chunk)), None,
                             range(len(chunk) - 1, len(chunk)) if last else range(0), capture)
            yield asks(job) if last else job
            if job.hidden is not None:
                hidden.append(job.hidden)
        return job, torch.cat(hidden) if hidden else None

    def tree_job(self, cache: Any, pending: int, tree: DraftTree,
                 capture: tuple[int, ...] = ()) -> ForwardJob:
        """[pending] + tree appended to the cache; row 0 of its logits is the target after the
        committed text, row i + 1 after draft node i."""
        base = cache.get_seq_length()
        n = len(tree)
        seen = np.zeros((1 + n, 1 + n), dtype=bool)
        seen[:, 0] = True
        seen[1:, 1:] = tree.ancestor_mask()
        positions = base + np.concatenate(([0], 1 + tree.depths()))
        return ForwardJob(cache, (pending, *tree.tokens), positions, seen, range(1 + n), capture)

    def drive(self, work: Work[T]) -> T:
        """Runs `work` with forwards of its own."""
        try:
            while True:
                self.run([next(work)])
        except StopIteration as done:
            return done.value

    def prefill(self, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]:
        """Runs the prompt; returns its cache and the logits after the last token: [vocab]."""
        cache = self.new_cache()
        return cache, self.drive(self.prefill_jobs(cache, prompt_ids))[0].logits[-1]

    def forward_tree(self, cache: Any, pending: int, tree: DraftTree) -> torch.Tensor:
        """Appends [pending] + tree to the cache; returns logits: [1 + n, vocab]."""
        job = self.tree_job(cache, pending, tree)
        self.run([job])
        return job.logits

    @torch.inference_mode()
    def run(self, jobs: Sequence[ForwardJob]) -> None:
        """One forward for all `jobs` (as few as the engine can); fills their results."""
        if len(jobs) > 1 and not self.batchable:
            raise RuntimeError(f"{self.model_id} cannot run several sessions in one forward")
        self.engine.run(jobs, next((job.capture for job in jobs if job.capture), ()))
        read_to_host(jobs)


def read_to_host(jobs: Sequence[ForwardJob]) -> None:
    """What the sessions read of a forward's logits on the host (ForwardJob.greedy,
    .successors_k), computed where the logits are and copied in one transfer: on a GPU one
    sync a forward rather than one or two a session, as a batch's sampling is done in the
    serving engines (vLLM's sampler, SGLang's)."""
    argmax = [job for job in jobs if job.greedy]
    best = [job for job in jobs if job.successors_k]
    parts = ([job.logits.argmax(-1) for job in argmax]
             + [job.logits.topk(job.successors_k, dim=-1).indices for job in best])
    if not parts:
        return
    flat = torch.cat([part.reshape(-1) for part in parts]).cpu().numpy()
    pieces = np.split(flat, np.cumsum([part.numel() for part in parts])[:-1])
    for job, piece in zip(argmax, pieces):
        job.choices = piece
    for job, piece, part in zip(best, pieces[len(argmax):], parts[len(argmax):]):
        job.successors = piece.reshape(part.shape)


def slot_plan(limits: Limits) -> SlotPlan:
    """The static engine's KV slots for these limits: one per session, each holding the
    longest prompt, every new token and a tree."""
    text = max(SLOT_TEXT_FLOOR, limits.max_prompt_tokens + limits.max_new_tokens)
    return SlotPlan(limits.max_sessions, text + limits.max_tree_nodes + 1, limits.max_tree_nodes)
