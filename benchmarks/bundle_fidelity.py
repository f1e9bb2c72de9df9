"""How closely each way of storing the edge half's weights drafts like its fp32 graph: the share
of step-graph rows whose first candidate is fp32's.

Records the step graph's inputs while the fp32 graphs draft in process (moa_tau's loop, greedy,
the evaluation prompts), then runs every variant on the same inputs: the bundle's int8 and
mixed graphs as built (the products in int8, activations included), and fp32 graphs whose
weights were rounded as a scheme would store them, one part at a time, which shows what each
part costs: 4 bits in blocks of 32 (cloud_server/moa/quantize_mixed.py's codes) for the draft
head, the drafter's layers or the embedding; 2 bits for the embedding rows outside the draft
vocabulary; int8 by row. MB: the graphs' files (step + memory) for the real ones.

    python -m benchmarks.bundle_fidelity [--per-set 2] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from shared import prompt_sets as evaluation
from shared.drafter_bundle import Graph, Precision, StepIO
from shared.messages import ChatMessage

Rounding = Callable[[np.ndarray], np.ndarray]  # rows [n, K] -> the same rows as stored


def blocks(bits: int) -> Rounding:
    from cloud_server.moa.quantize_mixed import dequantize_blocks, quantize_blocks

    return lambda rows: dequantize_blocks(*quantize_blocks(rows, bits), bits)


def int8_by_row(rows: np.ndarray) -> np.ndarray:
    from cloud_server.moa.quantize_mixed import int8_rows

    codes, scales = int8_rows(rows)
    return codes * scales[:, None]


# variant -> part -> rounding; parts: "draft" (the embedding's draft rows), "cold" (its other
# rows), "head" (the draft head, [N, K] rows), "layers" (every other matrix, [N, K] rows)
ROUNDED: dict[str, dict[str, Rounding]] = {
    "4 bits everywhere": {p: blocks(4) for p in ("draft", "cold", "head", "layers")},
    "head 4 bits": {"head": blocks(4)},
    "layers 4 bits": {"layers": blocks(4)},
    "embedding 4 bits": {"draft": blocks(4), "cold": blocks(4)},
    "embedding's other rows 2 bits": {"cold": blocks(2)},
    "head and draft rows int8": {"head": int8_by_row, "draft": int8_by_row},
}


def record_feeds(args: argparse.Namespace, target) -> tuple[Path, list[dict[str, np.ndarray]]]:
    """The bundle, and every step graph input its fp32 graphs ran on while drafting."""
    from benchmarks import moa_tau
    from edge_client.drafters.moa_graphs import MoaGraphs

    feeds: list[dict[str, np.ndarray]] = []
    run = MoaGraphs._step_run

    def recorded(self, feed):
        feeds.append({k: np.array(v) for k, v in feed.items()})
        return run(self, feed)

    MoaGraphs._step_run = recorded  # type: ignore[method-assign]
    try:
        tau_args = moa_tau.parse_args(["--drafters", "moa@fp32", "--drafter", str(args.drafter)])
        contender = moa_tau.contenders(tau_args, target)[0]
        for name in evaluation.SETS:
            for item in evaluation.load(name, args.per_set):
                prompt = target.apply_chat_template((ChatMessage("user", item["prompt"]),))
                moa_tau.split_decode(target, contender.server, contender.drafter, prompt,
                                     args.max_new_tokens, args.max_nodes)
                print(f"{item['id']}: {len(feeds)} steps", file=sys.stderr, flush=True)
    finally:
        MoaGraphs._step_run = run  # type: ignore[method-assign]
    assert contender.bundle is not None
    return contender.bundle, feeds


def rounded_graph(source: Path, parts: dict[str, Rounding], draft_rows: np.ndarray,
                  out: Path) -> Path:
    """`source` (fp32) with the parts' weights replaced by their rounded values."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    tables = {n.input[0] for n in model.graph.node if n.op_type == "Gather"
              and n.input[0] in values and values[n.input[0]].dtype == np.float32}
    matrices = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"
                and n.input[1] in values and values[n.input[1]].ndim == 2}
    new: dict[str, np.ndarray] = {}
    for name in tables:
        table = values[name].copy()
        cold = np.setdiff1d(np.arange(len(table)), draft_rows)
        for part, rows in (("draft", draft_rows), ("cold", cold)):
            if part in parts:
                table[rows] = parts[part](table[rows])
        new[name] = table
    for name in matrices:
        part = "head" if values[name].shape[1] == len(draft_rows) else "layers"
        if part in parts:
            new[name] = np.ascontiguousarray(parts[part](values[name].T).T)
    for tensor in model.graph.initializer:
        if tensor.name in new:
            tensor.CopyFrom(numpy_helper.from_array(new[tensor.name].astype(np.float32),
                                                    tensor.name))
    onnx.save(model, str(out))
    return out


def first_candidates(path: Path, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options)
    top = StepIO.OUTPUTS.index("top_ids")
    return np.concatenate([session.run(None, feed)[top][:, 0] for feed in feeds])


def run(args: argparse.Namespace) -> dict:
    from benchmarks import moa_tau
    from cloud_server.moa.weights import load_drafter
    from edge_client.drafters.moa_bundle import load_manifest

    target = moa_tau.load_target(moa_tau.parse_args([]))
    bundle, feeds = record_feeds(args, target)
    manifest = load_manifest(bundle)
    draft_rows = load_drafter(args.drafter, target.model)[2].vocab_ids.cpu().numpy()
    step = {p: bundle / manifest.graph(p, Graph.STEP) for p in manifest.graphs}
    reference = first_candidates(step[Precision.FP32], feeds)
    results: dict[str, tuple[float, float | None]] = {}
    for precision in (Precision.INT8, Precision.MIXED):
        size = sum((bundle / manifest.graph(precision, g)).stat().st_size for g in Graph)
        agree = float(np.mean(first_candidates(step[precision], feeds) == reference))
        results[f"{precision.value} graphs, as built"] = (agree, size / 1e6)
    with tempfile.TemporaryDirectory() as scratch:
        for name, parts in ROUNDED.items():
            path = rounded_graph(step[Precision.FP32], parts, draft_rows,
                                 Path(scratch) / "step.onnx")
            results[name] = (float(np.mean(first_candidates(path, feeds) == reference)), None)
    report(args, results, len(reference))
    return {k: {"agreement": a, "mb": mb} for k, (a, mb) in results.items()}


def report(args: argparse.Namespace, results: dict[str, tuple[float, float | None]],
           rows: int) -> None:
    table = markdown_table(("variant", "top-1 = fp32's", "graphs MB"),
                           [(k, f"{a:.3f}", f"{mb:.1f}" if mb else "-")
                            for k, (a, mb) in results.items()])
    write_results(args.name, f"Step-graph rows whose first candidate is the fp32 graph's: "
                             f"{rows} rows drafted in process by the fp32 graphs "
                             f"({args.drafter.name}, greedy, {args.per_set} prompts per set, "
                             f"{args.max_new_tokens} new tokens, trees <= {args.max_nodes} "
                             f"nodes); {machine()}\n\n{table}\n")
    grouped_bars(RESULTS / f"{args.name}.png", ["top-1 = fp32's"],
                 {k: [a] for k, (a, _) in results.items()}, "share of rows",
                 "Edge drafter: agreement with fp32 by weight storage")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from cloud_server.moa.weights import TRAINED

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafter", type=Path, default=TRAINED / "SmolLM2-135M-Instruct")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--name", default="bundle_fidelity", help="results file stem")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
