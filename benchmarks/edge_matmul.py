"""The edge step graph's products, one onnxruntime kernel at a time: what a weight byte costs.

The committed drafter's step is 13 products a call (results log, `edge_step_bytes`): the head
over the draft vocabulary (576 x 8192), six MLP products (576 x 1536 and back), four attention
ones (576 x 576) and two K/V ones (576 x 192). At the rows a step runs (1 for the first level,
up to the beam, 8, after) each reads its whole weight, so the step is bound by weight bytes.
This times each shape as a one-node graph, one thread, in the forms onnxruntime offers for it:
fp32 MatMul, int8 per column with the activations quantized at run time
(DynamicQuantizeMatMul, what the bundle ships), and MatMulNBits with 4 or 8 bits a weight in
blocks of 32 (accuracy level 0: fp32 compute; 4: int8 compute).

    python -m benchmarks.edge_matmul [--rows 1,8] [--repeat 300]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from cloud_server.moa.quantize_mixed import BLOCK, MS_DOMAIN, int8_rows, quantize_blocks

SHAPES = {"head 576x8192": (576, 8192), "MLP 576x1536": (576, 1536),
          "attention 576x576": (576, 576), "K/V 576x192": (576, 192)}
IR_VERSION = 9  # what onnxruntime 1.30, the GPU machine's, reads


def _graph(node: onnx.NodeProto, k: int, n: int, weights: list[onnx.TensorProto]
           ) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    graph = helper.make_graph([node], "product", [x], [y], weights)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])


def fp32(w: np.ndarray) -> tuple[onnx.ModelProto, int]:
    k, n = w.shape
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return _graph(node, k, n, [numpy_helper.from_array(w, "w")]), w.nbytes


def int8_columns(w: np.ndarray) -> tuple[onnx.ModelProto, int]:
    k, n = w.shape
    codes, scales = int8_rows(w.T)  # [n, k], [n]
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"], domain=MS_DOMAIN)
    weights = [numpy_helper.from_array(np.ascontiguousarray(codes.T), "w"),
               numpy_helper.from_array(scales, "s")]
    return _graph(node, k, n, weights), codes.nbytes + scales.nbytes


def n_bits(bits: int, accuracy: int) -> Callable[[np.ndarray], tuple[onnx.ModelProto, int]]:
    def build(w: np.ndarray) -> tuple[onnx.ModelProto, int]:
        k, n = w.shape
        codes, scales = quantize_blocks(w.T, bits)  # [n, k * bits / 8], [n, k / BLOCK]
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain=MS_DOMAIN, K=k,
                                N=n, bits=bits, block_size=BLOCK, accuracy_level=accuracy)
        weights = [numpy_helper.from_array(codes.reshape(n, k // BLOCK, -1), "w"),
                   numpy_helper.from_array(scales.astype(np.float32), "s")]
        return _graph(node, k, n, weights), codes.nbytes + 2 * scales.size
    return build


FORMS = {"fp32 MatMul": fp32, "int8 DynamicQuantizeMatMul (shipped)": int8_columns,
         "4-bit MatMulNBits, fp32 compute": n_bits(4, 0),
         "4-bit MatMulNBits, int8 compute": n_bits(4, 4),
         "8-bit MatMulNBits, int8 compute": n_bits(8, 4)}


def time_us(model: onnx.ModelProto, rows: int, k: int, repeat: int) -> float:
    """The median of `repeat` calls on `rows` rows, one thread, after 30 to warm up."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)}
    for _ in range(30):
        session.run(None, feed)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feed)
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--repeat", type=int, default=300)
    p.add_argument("--name", default="edge_matmul")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    cells, rows = [], []
    series: dict[str, list[float]] = {form: [] for form in FORMS}
    for shape, (k, n) in SHAPES.items():
        w = (0.05 * rng.standard_normal((k, n))).astype(np.float32)
        built = {form: make(w) for form, make in FORMS.items()}
        for r in (int(x) for x in args.rows.split(",")):
            cells.append(f"{shape}, {r} row{'s' * (r > 1)}")
            for form, (model, size) in built.items():
                us = time_us(model, r, k, args.repeat)
                series[form].append(us)
                rows.append((cells[-1], form, f"{size / 1e6:.2f}", f"{us:.1f}",
                             f"{size / us / 1e3:.1f}"))
    table = markdown_table(("product, rows", "form", "weight MB", "µs a call",
                            "weight GB/s"), rows)
    write_results(args.name, f"# One product of the edge step, one thread\n\n{machine()}; "
                             f"median of {args.repeat} calls\n\n{table}\n")
    grouped_bars(RESULTS / f"{args.name}.png", cells, series, "µs a call (one thread)",
                 "The edge step's products by kernel")


if __name__ == "__main__":
    main()
