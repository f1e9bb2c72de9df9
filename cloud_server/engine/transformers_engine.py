"""The target's forwards through transformers' own modules, eager: any causal LM, one Python
call per module. Several sessions share a forward as a ragged batch (ragged.py); each keeps a
DynamicCache (kv_cache.py). The fallback engine for what the static one cannot run, and the
reference the others are judged against."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from cloud_server.engine import ragged
from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.kv_cache import keep_path, whole_cache
from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.engine.session_mask import SessionMask, sliding_window


class ModulesEngine:
    exact_reference = True

    def __init__(self, model: PreTrainedModel, device: torch.device):
        self.model = model
        self.device = device
        self.batchable = ragged.install(model)
        if not self.batchable and sliding_window(model.config) is not None:
            raise ValueError(f"its sliding-window layers need transformers' attention "
                             f"interface, which {model.config._attn_implementation!r} "
                             f"attention does not go through")

    def describe(self) -> str:
        return f"transformers modules, eager, {str(self.model.dtype).split('.')[-1]}"

    @property
    def kv_bytes_per_token(self) -> int:
        element = next(self.model.parameters()).element_size()
        return kv_elements_per_token(self.model.config) * element

    def new_cache(self, most_positions: int | None = None) -> DynamicCache:
        """On the CPU the cache grows in place (kv_cache.py), to at most `most_positions`. On
        a GPU, transformers' concatenating cache: in place cost 1-4% a forward on an H100
        (`benchmarks/results/kv_growth_gpu.md`) where on the CPU it saved up to 25%."""
        return whole_cache(self.model.config, self.device.type == "cpu", most_positions)

    def keep_path(self, cache: DynamicCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
        keep_path(cache, base, accepted_nodes)

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Nothing to capture: every forward runs as it comes."""

    @torch.inference_mode()
    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        if len(jobs) > 1 and not self.batchable:
            raise RuntimeError("this model cannot run several sessions in one forward")
        offsets = np.cumsum([0] + [len(job.ids) for job in jobs])
        keep = np.concatenate([start + np.array(job.rows, dtype=np.int64)
                               for start, job in zip(offsets, jobs)])
        with LayerOutputs(self.model, capture) if capture else nullcontext() as captured:
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
        if self.device.type == "cuda":  # a CUDA forward returns before it has run
            torch.cuda.synchronize(self.device)

    def _cache_and_mask(self, jobs: Sequence[ForwardJob]
                        ) -> tuple[DynamicCache | ragged.RaggedCache, torch.Tensor | None]:
        if len(jobs) == 1 and sliding_window(self.model.config) is None:  # the model's own path
            job = jobs[0]
            return job.cache, None if job.seen is None else self._additive(allowed_of(job))
        masks = [self._session_mask(job) for job in jobs]
        return (ragged.RaggedCache([job.cache for job in jobs], [len(job.ids) for job in jobs],
                                   masks),
                ragged.PLACEHOLDER_MASK.to(self.device))

    def _session_mask(self, job: ForwardJob) -> SessionMask:
        cached = job.cache.get_seq_length()
        queries = torch.as_tensor(job.positions, device=self.device)
        keys = torch.cat([torch.arange(cached, device=self.device), queries])
        return SessionMask(self._additive(allowed_of(job)), queries, keys)

    def _additive(self, allowed: np.ndarray) -> torch.Tensor:
        """The additive form of a boolean mask: [1, 1, new, cached + new]."""
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(torch.from_numpy(~allowed).to(self.device), torch.finfo(dtype).min)
        return mask[None, None]


def allowed_of(job: ForwardJob) -> np.ndarray:
    """What each of the job's new tokens attends to: [new, cached + new]."""
    new, cached = len(job.ids), job.cache.get_seq_length()
    if job.seen is None:
        return np.tri(new, cached + new, cached, dtype=bool)
    allowed = np.ones((new, cached + new), dtype=bool)
    allowed[:, cached:] = job.seen
    return allowed


def kv_elements_per_token(config) -> int:
    """K and V of every layer's KV heads: the values one cached position holds."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim
