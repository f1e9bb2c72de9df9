"""Target Layer Inference (MoaConfig.tli_layers): the edge runs the target's own last layers
after the drafter's. The copies compute what the target's layers compute, training lowers the
loss without saving the target's weights, the exported graph keeps their K/V state the way the
torch drafter does, split decoding with it stays exact, and what it cannot run is refused."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModelForCausalLM

from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.activations import ServerActivations
from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.export import StepGraph, example_inputs
from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf
from cloud_server.moa.weights import WEIGHTS, load_drafter
from cloud_server.reference import compare, plain_greedy
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_bundle import load_manifest
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.trained import trained_drafter
from edge_client.drafters.tree_search import TreeSearch
from safetensors.torch import load_file
from shared import drafter_bundle
from shared.drafter_bundle import BundleError, BundleManifest, Graph, Precision, StepIO
from shared.drafting.base import DrafterName
from testkit.target_families import build_family
from testkit.tiny_drafters import fp32_bundle, train_tiny
from tests.in_process import split_greedy

PROMPT = [1, 46, 47, 48, 49]


@pytest.fixture(scope="module")
def tli_dir(tiny_target, tmp_path_factory):
    """A MoA drafter (LSA over every layer) ending in the tiny target's last layer."""
    return train_tiny(tiny_target, tmp_path_factory.mktemp("tiny-tli"), 60,
                      server_inputs=(ServerInput.LAYER_KV,), tli_layers=1)


@pytest.fixture(scope="module")
def tli_bundle(tiny_target, tli_dir, tmp_path_factory):
    return fp32_bundle(tiny_target, tli_dir, tmp_path_factory.mktemp("tli-bundle"))


@torch.no_grad()
def test_the_copied_layers_compute_the_targets(tiny_target):
    """Fed the target's own state before its last layer, the copy gives its last state."""
    model = tiny_target.model
    last = model.config.num_hidden_layers - 1
    edge = EdgeHalf.from_target(MoaConfig.from_target(model.config, tli_layers=1), model)
    assert edge.tli is not None
    ids = torch.tensor([PROMPT + [60, 61, 62]])
    with LayerOutputs(model, (last - 1, last)) as capture:
        model(input_ids=ids)
    states = capture.stacked()[0]  # [T, 2, width]
    positions = torch.arange(ids.shape[1])
    causal = additive_mask(torch.ones(len(positions), len(positions), dtype=torch.bool).tril())
    got, _, _ = edge.tli(states[None, :, 0], positions, causal[None, None])
    torch.testing.assert_close(got[0], states[:, 1], rtol=1e-4, atol=1e-4)


def test_training_keeps_the_target_layers_out_of_the_weights(tiny_target, tli_dir):
    summary = json.loads((tli_dir / "moa_config.json").read_text())
    assert summary["tli_layers"] == 1 and len(summary["lsa_layers"]) == 2
    assert not [name for name in load_file(tli_dir / WEIGHTS) if "tli" in name]
    config, _, edge = load_drafter(tli_dir, tiny_target.model)
    assert config.tli_layers == 1 and edge.tli is not None
    assert not any(p.requires_grad for p in edge.tli.parameters())


def test_tli_loss_falls(tiny_target, tmp_path):
    from cloud_server.training.data import Sample, answer_batch
    from cloud_server.training.moa import Trainer
    from cloud_server.training.settings import TrainSettings

    prompts = [[1, *range(40 + i, 44 + i)] for i in range(0, 24, 6)]
    samples = [Sample(tuple(p), tuple(a))
               for p, a in zip(prompts, answer_batch(tiny_target, prompts, max_new_tokens=24))]
    trainer = Trainer(tiny_target.model, samples,
                      TrainSettings(steps=40, batch_tokens=256, lr=3e-3, warmup=5,
                                    draft_vocab=200, tli_layers=1, checkpoint_every=1000),
                      tmp_path, stop_ids=(2,))
    losses = [trainer.train_step(trainer.batch_for(step))["loss"] for step in range(40)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_the_exported_step_equals_torch(tiny_target, tli_dir, tli_bundle):
    """With a K/V state of 1 + N layers' heads in and out."""
    _, _, edge = load_drafter(tli_dir, tiny_target.model)
    torch.manual_seed(3)
    _, step_args = example_inputs(edge)
    manifest = load_manifest(tli_bundle)
    assert step_args[2].shape[0] == manifest.state_heads == 2 * edge.config.kv_heads
    with torch.no_grad():
        want = StepGraph(edge, manifest.top_k)(*step_args)
    session = ort.InferenceSession(str(tli_bundle / manifest.graph(Precision.FP32, Graph.STEP)))
    got = session.run(None, {n: a.numpy() for n, a in zip(StepIO.INPUTS, step_args)})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-4, rtol=1e-4)


def test_the_edge_drafts_what_training_computes(tiny_target, tli_dir, tli_bundle):
    """The edge's incremental state (SA and target-layer K/V kept per position, reused by the
    next round) gives the draft a whole-sequence forward gives, with the same memory."""
    _, _, edge = load_drafter(tli_dir, tiny_target.model)
    activations = ServerActivations.load(tli_dir, tiny_target.model)
    context = PROMPT + [60, 61, 62]
    length = len(context)
    cache = tiny_target.model(input_ids=torch.tensor([context]), use_cache=True).past_key_values
    rows = activations(cache, 0, length - 1, dtype=np.float32)  # all but the last
    drafter = MoaDrafter(MoaGraphs(tli_bundle, Precision.FP32))
    drafter.reset(context)
    drafter.add_activations(0, rows)
    drafter.propose(context[:-1], 1)  # computes and keeps the state of context[:-2]
    memory = torch.zeros(1, length, rows.shape[1])
    memory[0, :length - 1] = torch.from_numpy(rows)
    seen = torch.arange(length)[None, :] < length - 1  # every query sees every row given
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    with torch.no_grad():
        hidden, _ = edge(torch.tensor([context]), memory, additive_mask(causal)[None, None],
                         additive_mask(seen.expand(length, length))[None, None])
    want = int(edge.vocab_ids[edge.logits(hidden[0, -1]).argmax()])
    assert drafter.propose(context, 1).tokens == (want,)


@pytest.mark.slow
def test_split_decoding_with_tli_equals_plain_greedy(tiny_target, tli_dir, tli_bundle):
    server = ServerActivations.load(tli_dir, tiny_target.model)
    drafter = trained_drafter(tli_bundle, DrafterName.MOA,
                              TreeSearch(max_depth=6, beam=4, branch=4), precision=Precision.FP32)
    tokens, _ = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=16)
    plain = plain_greedy(tiny_target, PROMPT, 32)
    verdict = compare(tiny_target, PROMPT, tokens, plain)  # the near-tie rule
    assert verdict.lossless, (verdict, tokens, plain)


def test_a_tli_bundle_is_refused_by_an_edge_that_predates_it(tli_bundle, monkeypatch):
    text = (tli_bundle / drafter_bundle.MANIFEST_NAME).read_text()
    assert json.loads(text)["format"] >= drafter_bundle.TLI_FORMAT  # its newest feature's
    before = drafter_bundle.FORMATS[:drafter_bundle.FORMATS.index(drafter_bundle.TLI_FORMAT)]
    monkeypatch.setattr(drafter_bundle, "FORMATS", before)
    with pytest.raises(BundleError, match="update the edge client"):
        BundleManifest.from_json(text)


def test_a_config_naming_layers_the_target_lacks_is_refused(tiny_target):
    config = MoaConfig.from_target(tiny_target.model.config).to_dict()
    with pytest.raises(ValueError, match="tli_layers 2: the target has 2 layers"):
        MoaConfig.from_dict(config | {"tli_layers": 2})
    with pytest.raises(ValueError, match=r"lsa_layers names layers \[5\]"):
        MoaConfig.from_dict(config | {"lsa_layers": [1, 5]})
    with pytest.raises(ValueError, match="Target Layer Inference runs after a one-token"):
        MoaConfig.from_dict(config | {"tli_layers": 1, "block": 2})


def test_a_drafter_for_another_target_is_refused(tiny_target, tli_dir, tmp_path):
    other = AutoModelForCausalLM.from_pretrained(build_family("qwen3", tmp_path / "q3"))
    with pytest.raises(ValueError, match="the drafter's target_layers is 2, the target's 3"):
        load_drafter(tli_dir, other)


@pytest.mark.parametrize("family, reason", [("mistral", "sliding window"),
                                            ("qwen3", "not a plain pre-norm block"),
                                            ("llama3", "not a plain pre-norm block")])
def test_layers_the_edge_cannot_run_exactly_are_refused(family, reason, tmp_path):
    """Mistral's window, Qwen3's q/k norms, Llama 3's scaled RoPE."""
    model = AutoModelForCausalLM.from_pretrained(build_family(family, tmp_path / family))
    config = MoaConfig.from_target(model.config, tli_layers=1)
    with pytest.raises(ValueError, match=f"tli_layers: the target's layer .*{reason}"):
        EdgeHalf.from_target(config, model)


def test_train_drafter_takes_tli_for_moa_only(tmp_path, capsys):
    from cloud_server.training.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--tli-layers", "1", "--method", "falcon"])
    assert exit_info.value.code == 2
    assert "--tli-layers runs after a one-token drafter" in capsys.readouterr().err
