"""Mixed-precision weights in the edge's graphs (cloud_server/moa/quantize_mixed.py): the codes
decode to what they encode, the rewritten graph gathers and multiplies with the stored weights,
and a tied head is stored once."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cloud_server.moa.quantize_mixed import (
    BLOCK, COLD_BITS, dequantize_blocks, int8_rows, quantize_blocks, quantize_mixed,
)

VOCAB, WIDTH, OUT = 96, 64, 40
DRAFT_ROWS = np.array([7, 3, 90, 0, 41, 12])


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_decode_no_worse_than_absmax_rounding(bits):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((5, 4 * BLOCK)).astype(np.float32)
    weights[1, BLOCK:2 * BLOCK] *= 50  # a block of another scale
    weights[2, :BLOCK] = 0.0  # an all-zero block decodes to zeros
    codes, scales = quantize_blocks(weights, bits)
    assert codes.shape == (5, 4 * BLOCK * bits // 8) and codes.dtype == np.uint8
    assert scales.shape == (5, 4) and scales.dtype == np.float16
    decoded = dequantize_blocks(codes, scales, bits)
    assert (decoded[2, :BLOCK] == 0).all()
    blocks = weights.reshape(5, 4, BLOCK)
    high = 2 ** (bits - 1) - 1
    step = (np.abs(blocks).max(axis=-1, keepdims=True) / high).astype(np.float16)
    step = np.where(step == 0, 1, step).astype(np.float32)
    plain = np.clip(np.rint(blocks / step), -high - 1, high) * step  # rounded at absmax / max
    error = ((decoded.reshape(5, 4, BLOCK) - blocks) ** 2).sum(axis=-1)
    assert (error <= ((plain - blocks) ** 2).sum(axis=-1) + 1e-6).all()


def graph(embedding: np.ndarray, head: np.ndarray, other: np.ndarray) -> onnx.ModelProto:
    """ids -> embedding rows x, then x @ head and x @ other, as the exporter writes them."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], axis=0),
             helper.make_node("MatMul", ["x", "head"], ["logits"]),
             helper.make_node("MatMul", ["x", "other"], ["y"])]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "q"])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
         for name in ("x", "logits", "y")],
        [numpy_helper.from_array(embedding, "table"), numpy_helper.from_array(head, "head"),
         numpy_helper.from_array(other, "other")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def tied(tmp_path):
    rng = np.random.default_rng(1)
    embedding = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    other = rng.standard_normal((WIDTH, OUT)).astype(np.float32)
    source = tmp_path / "g.onnx"
    onnx.save(graph(embedding, np.ascontiguousarray(embedding[DRAFT_ROWS].T), other),
              str(source))
    return source, embedding, other


def stored_table(embedding: np.ndarray) -> np.ndarray:
    """The embedding as the graph holds it: draft rows int8, the others in 2-bit codes."""
    table = np.empty_like(embedding)
    codes, scales = int8_rows(embedding[DRAFT_ROWS])
    table[DRAFT_ROWS] = codes * scales[:, None]
    cold = np.setdiff1d(np.arange(VOCAB), DRAFT_ROWS)
    table[cold] = dequantize_blocks(*quantize_blocks(embedding[cold], COLD_BITS), COLD_BITS)
    return table


def test_graph_gathers_and_multiplies_the_stored_weights(tied, tmp_path):
    source, embedding, other = tied
    quantize_mixed(source, tmp_path / "q.onnx", DRAFT_ROWS, tied=True)
    session = ort.InferenceSession(str(tmp_path / "q.onnx"))
    ids = np.array([[5, 90, 0, 95]])  # cold, draft, draft, cold
    x, logits, y = session.run(None, {"ids": ids})
    table = stored_table(embedding)
    assert x.shape == (1, 4, WIDTH)  # each row as stored (the 2-bit ones decoded in fp16)
    np.testing.assert_allclose(x, table[ids], rtol=2 ** -10, atol=1e-7)
    # products: int8 weights, int8 activations (within 1% of the output's range)
    head = table[DRAFT_ROWS].T
    codes, scales = int8_rows(other.T)
    wide = (codes * scales[:, None]).T
    np.testing.assert_allclose(logits, x @ head, atol=0.01 * np.abs(x @ head).max())
    np.testing.assert_allclose(y, x @ wide, atol=0.01 * np.abs(x @ wide).max())


def matrices(path, dtype: int) -> set[str]:
    return {t.name for t in onnx.load(str(path)).graph.initializer
            if t.data_type == dtype and len(t.dims) == 2}


def test_a_tied_head_is_stored_once(tied, tmp_path):
    source, embedding, other = tied
    quantize_mixed(source, tmp_path / "tied.onnx", DRAFT_ROWS, tied=True)
    quantize_mixed(source, tmp_path / "untied.onnx", DRAFT_ROWS, tied=False)
    # int8: the draft rows and other, and in the untied graph the head too
    assert len(matrices(tmp_path / "tied.onnx", TensorProto.INT8)) == 2
    assert len(matrices(tmp_path / "untied.onnx", TensorProto.INT8)) == 3
    for name in ("tied", "untied"):
        assert not matrices(tmp_path / f"{name}.onnx", TensorProto.FLOAT)
        ops = [n.op_type for n in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node]
        assert ops.count("DynamicQuantizeMatMul") == 2
    # a head that only looks tied (one weight differs) is stored on its own
    head = np.ascontiguousarray(embedding[DRAFT_ROWS].T)
    head[0, 0] += 1.0
    onnx.save(graph(embedding, head, other), str(source))
    quantize_mixed(source, tmp_path / "near.onnx", DRAFT_ROWS, tied=True)
    assert len(matrices(tmp_path / "near.onnx", TensorProto.INT8)) == 3


def test_without_a_draft_vocabulary_every_row_is_int8(tied, tmp_path):
    source, embedding, other = tied
    quantize_mixed(source, tmp_path / "q.onnx", None, tied=False)
    x, _, _ = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"ids": np.array([[5]])})
    codes, scales = int8_rows(embedding)
    np.testing.assert_allclose(x[0, 0], codes[5] * scales[5], rtol=1e-6)
