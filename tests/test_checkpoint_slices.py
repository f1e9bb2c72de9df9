"""A tensor-parallel rank reads its shard from the checkpoint a slice at a time
(cloud_server/engine/checkpoint_slices.py): the same weights as cutting the loaded model, for
each family the static engine splits (Llama 3's untied head, Qwen2's q/k/v biases, Qwen3's
q/k norms), from one file or several; a checkpoint it cannot read by name is loaded whole."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cloud_server.engine.checkpoint_slices import CheckpointSlices
from cloud_server.engine.parallel_engine import ShardJob
from cloud_server.engine.rank_worker import skeleton
from cloud_server.engine.static_engine import SlotPlan
from cloud_server.engine.static_llama import StaticLlama
from cloud_server.engine.tensor_parallel import shard
from testkit.target_families import build_family

CPU = torch.device("cpu")


def _tensors(net: StaticLlama) -> list[torch.Tensor | None]:
    """Every weight of a shard, in a fixed order."""
    out: list[torch.Tensor | None] = [net.embed, net.norm, net.head, net.inv_freq]
    for layer in net.layers:
        for f in fields(layer):
            part = getattr(layer, f.name)
            out += [part.weight, part.bias] if hasattr(part, "weight") else [part]
    return out


def _job(path: Path) -> ShardJob:
    return ShardJob(str(path), torch.float32, "cpu", SlotPlan(1, 64, 8), None, False)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_a_ranks_slices_read_from_the_checkpoint_are_the_loaded_models_cut(
        tmp_path, family, shard_size):
    path = build_family(family, tmp_path / family)
    if shard_size:  # several files and their index, as large checkpoints ship
        model = AutoModelForCausalLM.from_pretrained(path)
        (path / "model.safetensors").unlink()
        model.save_pretrained(path, max_shard_size=shard_size)
        assert (path / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    meta, read = skeleton(_job(path))
    assert read is not None and next(meta.parameters()).is_meta
    for rank in (0, 1):
        whole = _tensors(shard(loaded, rank, 2, lambda t: t, CPU))
        sliced = _tensors(shard(meta, rank, 2, lambda t: t, CPU, read))
        assert len(whole) == len(sliced)
        # a graph capture writes in place in any grad mode: nothing may ask for autograd
        assert not any(t is not None and t.requires_grad for t in whole + sliced)
        for a, b in zip(whole, sliced):
            assert (a is None and b is None) or (
                a is not None and b is not None and torch.equal(a, b))


def test_a_slice_is_read_alone(tmp_path):
    path = build_family("llama3", tmp_path / "llama3")
    slices = CheckpointSlices(path)
    part = slices.read("model.layers.0.self_attn.q_proj.weight", slice(16, 32), slice(None))
    assert part.shape == (16, 64)
    assert slices.missing(["model.norm.weight", "no.such.weight"]) == ["no.such.weight"]


def test_a_checkpoint_under_other_names_is_loaded_whole(tmp_path, capsys):
    """Names transformers maps when it loads (an older layout's) are not the model's own: the
    rank cannot read them by name, so it loads the checkpoint as transformers does."""
    from safetensors.torch import load_file, save_file

    path = build_family("qwen2", tmp_path / "qwen2")
    weights = load_file(path / "model.safetensors")
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    loaded, read = skeleton(_job(path))
    assert read is None and not next(loaded.parameters()).is_meta
    assert "loads it whole" in capsys.readouterr().err
