"""Where the 4-bit engine's forward goes: the same forward with a part of its graph left out.

The variants are wrong on purpose. They only time what a part costs:
- `as built`: the engine's graph.
- `no mins term`: without Q4_1's per-block minimum (the Reshape, ReduceSum, MatMul and Add that
  each 4-bit product adds beside MatMulNBits, onnx_llama._linear).
- `no attention`: each layer's queries pass through where attention would be (the per-session
  attention over the cache, in double, onnx_llama._attend).
- `neither`: both left out. What remains is the weight products, norms, RoPE and the head.

Each variant times a decoding step and an 8-node tree on one session over a `--context`-token
prompt, through OnnxEngine.run as the server calls it, in this one process; the variants
take turns for `--rounds` rounds, so drift on the machine falls on all. llama.cpp's step on
the same GGUF is the yardstick (results log, `peer_q4_s37`).

    python -m benchmarks.q4_step_parts --context 128 --reps 30 --rounds 3
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from contextlib import nullcontext
from unittest import mock

import torch

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from benchmarks.graph_build import TREE, forward_s
from cloud_server import model_store
from cloud_server.engine import onnx_llama
from cloud_server.engine.onnx_engine import OnnxEngine, llama_weights
from cloud_server.target import TargetModel
from shared.tree import DraftTree

FORWARDS = {"step": DraftTree.chain([]), "tree of 8": TREE}
VARIANTS = ("as built", "no mins term", "no attention", "neither")


def _queries_through(g, s, q, k, v, layer, b):
    """In place of attention: the queries [kv, groups, t, hd] as [t, width]."""
    return g.op("Reshape", g.op("Transpose", q, perm=[2, 0, 1, 3]),
                g.ints(-1, s.heads * s.head_dim))


def variant_engine(target: TargetModel, variant: str) -> OnnxEngine:
    """An engine whose one-session graph leaves out what `variant` names, built now."""
    model = target.model
    weights = llama_weights(model, model_store.gguf_of("default"))
    if variant in ("no mins term", "neither"):
        weights = dataclasses.replace(weights, blocks={
            name: dataclasses.replace(b, mins=None) for name, b in weights.blocks.items()})
    engine = OnnxEngine(model.config, weights, model.get_input_embeddings(),
                        torch.get_num_threads())
    leave_out = variant in ("no attention", "neither")
    with mock.patch.object(onnx_llama, "_attend", _queries_through) if leave_out else nullcontext():
        engine.warm_up()
    return engine


def forward_ms(target: TargetModel, engine: OnnxEngine, context: int, tree: DraftTree,
               reps: int) -> float:
    """Median ms of one forward of `tree` (after a pending token) over the prompt."""
    caches = [target.prefill([(13 * i) % 4000 + 100 for i in range(context)])[0]]
    times = [forward_s(target, engine, caches, 42, tree) for _ in range(reps + 3)]
    return 1000 * statistics.median(times[3:])


def rounds_ms(target: TargetModel, context: int, reps: int, rounds: int
              ) -> dict[tuple[str, str], float]:
    """By (variant, kind), the median over `rounds` of each round's median forward. A round
    builds each variant's engine in turn and drops it before the next: an idle onnxruntime
    session's threads spin, and would slow the one being timed."""
    found: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            engine = variant_engine(target, variant)
            for kind, tree in FORWARDS.items():
                ms = forward_ms(target, engine, context, tree, reps)
                found.setdefault((variant, kind), []).append(ms)
                print(f"{variant:>14} {kind:>9} {ms:6.2f} ms", flush=True)
            del engine
    return {cell: statistics.median(times) for cell, times in found.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=30, help="forwards a cell in each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="q4_step_parts")
    args = p.parse_args()
    path, model_id = model_store.resolve("default")
    target = TargetModel.load(path, model_id, "cpu", weights="q4",
                              gguf=model_store.gguf_of("default"))
    ms = rounds_ms(target, args.context, args.reps, args.rounds)
    body = [(v, *(f"{ms[v, k]:.2f}" for k in FORWARDS),
             *(f"{ms['as built', k] - ms[v, k]:.2f}" for k in FORWARDS)) for v in VARIANTS]
    header = ("graph", *(f"{k} ms" for k in FORWARDS),
              *(f"{k}: ms the part left out costs" for k in FORWARDS))
    text = (f"# The 4-bit engine's forward, parts left out\n\n{model_id}, one session, a "
            f"{args.context}-token prompt, the median over {args.rounds} rounds of the median of "
            f"{args.reps} forwards; {machine()}, "
            f"{torch.get_num_threads()} threads\n\n" + markdown_table(header, body) + "\n")
    write_results(args.name, text)
    grouped_bars(RESULTS / f"{args.name}.png", list(VARIANTS),
                 {k: [ms[v, k] for v in VARIANTS] for k in FORWARDS}, "ms per forward",
                 f"The 4-bit engine's forward with parts left out, {model_id}")


if __name__ == "__main__":
    main()
