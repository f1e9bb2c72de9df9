"""The edge's step graph with grouped-query attention stacked (cloud_server/moa/layers.py) against
the textbook form that copies each K/V head per query head (testkit/copied_kv_attention.py).

Exports the committed drafter's edge half both ways as the bundle serves it (mixed precision),
then times one step-graph call on one core (benchmarks/step_timing.py's edge_step_ms) for
each context length and row count, the two graphs alternating, the best of --rounds medians.

    python -m benchmarks.edge_step_gqa [--contexts 100,300,1000] [--rows 1,8] [--rounds 5]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from shared.drafter_bundle import Precision


def bundles(scratch: Path) -> dict[str, Path]:
    """The committed drafter's mixed bundle, built with each attention."""
    from unittest import mock

    from benchmarks.moa_tau import load_target, parse_args
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.moa.layers import Attention
    from cloud_server.moa.weights import TRAINED
    from testkit.copied_kv_attention import copied_kv_forward

    target = load_target(parse_args([]))
    drafter = TRAINED / "SmolLM2-135M-Instruct"

    def build(name: str) -> Path:
        return build_bundle(drafter, target.model, target.model_id, scratch / name,
                            precisions=(Precision.MIXED,))

    with mock.patch.object(Attention, "forward", copied_kv_forward):
        copied = build("copied")
    return {"K/V copied per head": copied, "heads stacked": build("stacked")}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.step_timing import edge_step_ms

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        built = bundles(Path(scratch))
        for context in args.contexts:
            for rows in args.rows:
                cell = f"{context} tokens, {rows} rows"
                times: dict[str, list[float]] = {name: [] for name in built}
                for _ in range(args.rounds):
                    for name, bundle in built.items():
                        times[name].append(edge_step_ms(bundle, Precision.MIXED, rows, context))
                results[cell] = {name: min(t) for name, t in times.items()}
    names = list(next(iter(results.values())))
    rows = [(cell, *(f"{t[n]:.3f}" for n in names), f"{t[names[1]] / t[names[0]]:.2f}")
            for cell, t in results.items()]
    table = markdown_table(("context, rows", *(f"{n} ms" for n in names), "ratio"), rows)
    write_results(args.name, f"One step-graph call of the committed drafter's mixed bundle, "
                             f"one onnxruntime thread, best of {args.rounds} medians of 20; "
                             f"{machine()}\n\n{table}\n")
    grouped_bars(RESULTS / f"{args.name}.png", list(results),
                 {n: [t[n] for t in results.values()] for n in names}, "ms per step call",
                 "Edge step graph: grouped-query attention without K/V copies")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def numbers(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", type=numbers, default=[100, 300, 1000])
    p.add_argument("--rows", type=numbers, default=[1, 8])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default="edge_step_gqa", help="results file stem")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
