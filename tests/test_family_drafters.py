"""MoA and Falcon drafters for the families operators serve (testkit/target_families.py): the
edge half's shared ends are the target's (Gemma's scaled embedding, 1 + weight norm and
soft-capped logits included), a short training run lowers the loss, the exported ONNX graphs
equal the torch drafter, and split greedy decoding with the drafter's bundle is plain greedy
decoding."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.export import MemoryGraph, StepGraph, example_inputs
from cloud_server.moa.model import EdgeHalf
from cloud_server.moa.weights import load_drafter
from cloud_server.target import TargetModel
from cloud_server.training.data import Sample, answer_batch
from cloud_server.training.moa import Trainer
from cloud_server.training.settings import TrainSettings
from edge_client.drafters.moa_bundle import load_manifest
from shared.drafter_bundle import Graph, Memory, MemoryIO, Precision, StepIO
from shared.messages import Limits
from testkit.split_checks import assert_split_greedy_is_plain
from testkit.target_families import FAMILIES, build_family
from testkit.tiny_drafters import fp32_bundle
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

pytestmark = pytest.mark.slow

STEPS = 30
MOA = TrainSettings(steps=STEPS, batch_tokens=256, lr=3e-3, warmup=5, draft_vocab=200,
                    checkpoint_every=1000,
                    server_inputs=(ServerInput.LAST_HIDDEN, ServerInput.LAYER_KV))
RUNS = {"moa": MOA, "falcon": replace(MOA, server_inputs=(ServerInput.LAST_HIDDEN,), block=2)}
PROMPTS = [[1, 46, 47, 48, 49], [1, 52, 53, 54, 55, 56, 57, 58, 59, 60], [1, 60, 61, 62]]
MAX_NEW = 24
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> TargetModel:
    path = build_family(request.param, tmp_path_factory.mktemp(request.param))
    return TargetModel.load(str(path), request.param, "cpu")


@pytest.fixture(scope="module")
def trained(target: TargetModel, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, tuple[Path, list[float]]]:
    """Per run of RUNS: the drafter directory (MoA: input 'last', and 'kv' in kv/) and the
    loss of every step."""
    prompts = [[1, *range(40 + i, 44 + i)] for i in range(0, 48, 6)]
    answers = answer_batch(target, prompts, max_new_tokens=32)
    samples = [Sample(tuple(p), tuple(a)) for p, a in zip(prompts, answers)]
    runs = {}
    for name, settings in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        trainer = Trainer(target.model, samples, settings, out, stop_ids=(2,))
        losses = [trainer.train_step(trainer.batch_for(s))["loss"] for s in range(STEPS)]
        trainer.save_weights(out)
        runs[name] = out, losses
    return runs


def test_the_edge_half_shares_the_targets_ends(target):
    """Embedding rows as the target's first layer reads them; the target's logits from its
    last layer's output through the drafter's final norm and head."""
    model = target.model
    edge = EdgeHalf.from_target(MoaConfig.from_target(model.config), model)
    ids = torch.tensor([PROMPTS[1]])  # [1, T]
    last = model.config.num_hidden_layers - 1
    with torch.no_grad(), LayerOutputs(model, (last,)) as capture:
        out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(edge.embedding[ids], out.hidden_states[0])
    logits = edge.logits(edge.normed(capture.stacked()[:, :, 0]))  # [1, T, vocab]
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_training_lowers_the_loss(trained, run):
    _, losses = trained[run]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses


@pytest.mark.parametrize("run", sorted(RUNS))
def test_exported_graphs_equal_the_torch_drafter(target, trained, run, tmp_path):
    drafter_dir, _ = trained[run]
    bundle = fp32_bundle(target, drafter_dir, tmp_path)
    manifest = load_manifest(bundle)
    _, _, edge = load_drafter(drafter_dir, target.model)
    torch.manual_seed(1)
    (activations, positions), step_args = example_inputs(edge)
    with torch.no_grad():
        want = [*StepGraph(edge, manifest.top_k)(*step_args),
                *MemoryGraph(edge)(activations, positions)]
    step = ort.InferenceSession(str(bundle / manifest.graph(Precision.FP32, Graph.STEP)))
    memory = ort.InferenceSession(str(bundle / manifest.graph(Precision.FP32, Graph.MEMORY)))
    got = [*step.run(None, {n: a.numpy() for n, a in zip(StepIO.INPUTS, step_args)}),
           *memory.run(None, {MemoryIO.rows(Memory.ACTIVATIONS): activations.numpy(),
                              MemoryIO.POSITIONS: positions.numpy()})]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("run, student", [("moa", ""), ("moa", ServerInput.LAYER_KV.value),
                                          ("falcon", "")])
def test_split_greedy_with_the_drafter_is_plain_greedy(target, trained, run, student,
                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    config = ServerConfig(LIMITS, drafter_dir=trained[run][0] / student)
    with ServerThread(target, config) as server:
        # briefly trained: whether it drafts anything right depends on this CPU's kernels
        assert_split_greedy_is_plain(target, server.address, run, 16, PROMPTS, MAX_NEW,
                                     expect_accepted=False)
