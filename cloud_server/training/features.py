"""The target's answers with their captured layer outputs, read back from the shards that
engine_answers.py writes, and the teacher pass they stand in for.

With stored features the trainer runs no target forward per batch: the server half's input and
the feature loss's target (the last layer's output through the target's final norm, exactly
what the target's own forward ends in) come from the rows captured while the target wrote the
answers. Students that read what no shard holds (per-layer K/V for Layer Self-Attention,
another layer) get the teacher pass as before (moa.teacher).
"""
from __future__ import annotations

from pathlib import Path
from safetensors.torch import load_file

from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.training.data import Sample
from cloud_server.training.engine_answers import SHARD_GLOB


def load_shards(out: Path) -> tuple[list[Sample], tuple[int, ...]]:
    """Every sample of the shards in `out` with its features [length, L, width] (views of the
    shard's tensor), and the layers they hold."""
    samples: list[Sample] = []
    layers: tuple[int, ...] | None = None
    for path in sorted(out.glob(SHARD_GLOB)):
        shard = load_file(str(path))
        held = tuple(shard["layers"].tolist())
        if layers is not None and held != layers:
            raise ValueError(f"{path} holds layers {held}, the shards before it {layers}")
        layers = held
        ids, offsets = shard["ids"].tolist(), shard["offsets"].tolist()
        for i, prompt_len in enumerate(shard["prompt_lens"].tolist()):
            start, end = offsets[i], offsets[i + 1]
            samples.append(Sample(tuple(ids[start: start + prompt_len]),
                                  tuple(ids[start + prompt_len: end]),
                                  shard["hidden"][start: end]))
    return samples, layers or ()


def covers(layers: tuple[int, ...], configs: list[MoaConfig]) -> bool:
    """Whether stored `layers` give every student what it reads, and the feature loss its
    target (the last layer)."""
    needed = {configs[0].target_layers - 1}
    for config in configs:
        if config.uses_activations and config.server_input is ServerInput.LAYER_KV:
            return False
        if config.uses_activations:
            needed |= set(config.hidden_layers)
        if config.tli_layers:
            needed.add(config.target_layers - config.tli_layers - 1)
    return needed <= set(layers)
