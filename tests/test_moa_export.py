"""ONNX export of the MoA edge half: the graphs equal the torch modules, the int8 and mixed
graphs stay close, and the bundle survives archive -> install with every sha256 checked."""
from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cloud_server.moa.bundle import archive
from cloud_server.moa.export import MemoryGraph, StepGraph, example_inputs, quantize_int8
from cloud_server.moa.weights import load_drafter
from edge_client.drafters.moa_bundle import install_bundle, load_manifest, verify
from shared.drafter_bundle import (
    MIXED_FORMAT, BundleError, BundleManifest, Graph, Memory, MemoryIO, Precision, StepIO,
)


def run_both(tiny_target, tiny_drafter_dir, tiny_bundle, precision: Precision,
             draft_ids: bool = False):
    """`draft_ids`: the step's tokens from the draft vocabulary, as drafting's are."""
    torch.manual_seed(1)
    _, _, edge = load_drafter(tiny_drafter_dir, tiny_target.model)
    memory_args, step_args = example_inputs(edge)
    if draft_ids:
        step_args = (edge.vocab_ids[-len(step_args[0]):], *step_args[1:])
    manifest = load_manifest(tiny_bundle)
    with torch.no_grad():
        want = StepGraph(edge, manifest.top_k)(*step_args)
    session = ort.InferenceSession(str(tiny_bundle / manifest.graph(precision, Graph.STEP)))
    got = session.run(None, {n: a.numpy() for n, a in zip(StepIO.INPUTS, step_args)})
    return [w.numpy() for w in want], got, edge, memory_args, manifest


def test_fp32_step_matches_torch(tiny_target, tiny_drafter_dir, tiny_bundle):
    want, got, _, _, _ = run_both(tiny_target, tiny_drafter_dir, tiny_bundle, Precision.FP32)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_fp32_memory_matches_torch(tiny_target, tiny_drafter_dir, tiny_bundle):
    _, _, edge, (acts, positions), manifest = run_both(tiny_target, tiny_drafter_dir,
                                                        tiny_bundle, Precision.FP32)
    with torch.no_grad():
        want = MemoryGraph(edge)(acts, positions)
    session = ort.InferenceSession(str(tiny_bundle / manifest.graph(Precision.FP32,
                                                                    Graph.MEMORY)))
    got = session.run(None, {MemoryIO.rows(Memory.ACTIVATIONS): acts.numpy(),
                             MemoryIO.POSITIONS: positions.numpy()})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.MIXED])
def test_quantized_step_stays_close(tiny_target, tiny_drafter_dir, tiny_bundle, precision):
    """Mixed keeps 2 bits a weight for the rows outside the draft vocabulary: drafted tokens
    come from inside it (tests/test_quantize_mixed.py checks both kinds of row)."""
    want, got, _, _, _ = run_both(tiny_target, tiny_drafter_dir, tiny_bundle, precision,
                                  draft_ids=precision is Precision.MIXED)
    logits, top_ids = want[0], want[2]
    assert np.abs(got[0] - logits).max() < 0.1 * np.abs(logits).max()
    assert (got[2][:, 0] == top_ids[:, 0]).mean() >= 0.5


def test_bundle_archive_installs_and_verifies(tiny_bundle, tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    data = archive(tiny_bundle)
    assert data == archive(tiny_bundle)  # deterministic: one sha256 per bundle
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(BundleError):
        install_bundle(data, "0" * 64)
    installed = install_bundle(data, sha)
    assert installed.name == tiny_bundle.name
    manifest = verify(installed)
    assert {"step.onnx", "step.int8.onnx", "step.mixed.onnx", "memory.onnx",
            "memory.int8.onnx", "memory.mixed.onnx"} <= set(manifest.files)
    assert "tokenizer.json" not in manifest.files  # the edge fetches it once, on its own
    (installed / "step.int8.onnx").write_bytes(b"corrupt")
    with pytest.raises(BundleError):
        verify(installed)


def test_int8_only_bundle(tiny_target, tiny_drafter_dir, tmp_path):
    from cloud_server.moa.bundle import build_bundle

    bundle = build_bundle(tiny_drafter_dir, tiny_target.model, "tiny-llama", tmp_path,
                          precisions=(Precision.INT8,))
    manifest = verify(bundle)
    assert set(manifest.graphs) == {Precision.INT8}
    assert not (bundle / "step.onnx").exists()


def test_quantizing_logs_no_advice_to_pre_process(tiny_bundle, tmp_path, caplog):
    """onnxruntime advises pre-processing on the root logger for every graph it quantizes:
    on a fresh setup the console showed it for every bundle built. Only that line goes."""
    caplog.set_level(logging.WARNING)
    quantize_int8(tiny_bundle / "step.onnx", tmp_path / "step.int8.onnx")
    assert not [r for r in caplog.records if "pre-processing" in r.getMessage()]
    assert not logging.getLogger().filters


def test_int8_graph_quantizes_the_embedding_and_head(tiny_bundle):
    import onnx

    model = onnx.load(str(tiny_bundle / "step.int8.onnx"))
    assert not [n.output[0] for n in model.graph.node if n.op_type == "Constant"
                and n.attribute[0].t.ByteSize() > 4096]
    matrices = [i.name for i in model.graph.initializer
                if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 2]
    assert not matrices  # every weight matrix, the embedding and head included, is int8
    assert {"MatMulInteger", "Gather"} <= {n.op_type for n in model.graph.node}


def test_independent_memory_graph_reads_ids(tiny_target, tiny_drafter_dir, tiny_independent_bundle):
    """The baseline's memory graph takes token ids and equals the torch module."""
    from cloud_server.training.moa import INDEPENDENT

    _, _, edge = load_drafter(tiny_drafter_dir / INDEPENDENT, tiny_target.model)
    (ids, positions), _ = example_inputs(edge)
    with torch.no_grad():
        want = MemoryGraph(edge)(ids, positions)
    manifest = load_manifest(tiny_independent_bundle)
    assert manifest.memory is Memory.EMBEDDINGS
    session = ort.InferenceSession(
        str(tiny_independent_bundle / manifest.graph(Precision.FP32, Graph.MEMORY)))
    got = session.run(None, {MemoryIO.rows(Memory.EMBEDDINGS): ids.numpy(),
                             MemoryIO.POSITIONS: positions.numpy()})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-5, rtol=1e-4)


def test_manifest_round_trips_and_refuses_what_it_cannot_read(tiny_bundle):
    manifest = load_manifest(tiny_bundle)
    assert BundleManifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_json() == (tiny_bundle / "bundle.json").read_text()  # what was hashed
    assert manifest.format == MIXED_FORMAT  # it offers mixed-precision graphs
    newer = manifest.to_json().replace(f'"format": {MIXED_FORMAT}', '"format": 6')
    with pytest.raises(BundleError, match=r"format 6 is not one of \(1, 2, 3, 4, 5\)"):
        BundleManifest.from_json(newer)
    with pytest.raises(BundleError, match="malformed"):
        BundleManifest.from_json('{"format": 1, "graphs": {"fp64": {}}}')
    with pytest.raises(BundleError, match="not JSON"):
        BundleManifest.from_json("{")
    with pytest.raises(BundleError, match="precision int8 not in the bundle"):
        BundleManifest("m", 8, {}, {}, {Precision.FP32: {}}).graph(Precision.INT8, Graph.STEP)
