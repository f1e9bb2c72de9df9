"""How long the 4-bit engine takes to build its graph for n sessions a forward, against what the
graph's forwards then cost, at each of onnxruntime's optimization levels.

A graph is built the first time a batch of its size comes, and every session waits meanwhile
(results log, `capacity_load_wait4`). This measures whether a lighter optimization builds it
faster without slowing the forwards: n sessions, each a pending token and an 8-node tree over a
`--context`-token prompt, timed after the build, on the default model in this one process.

    python -m benchmarks.graph_build --sessions 1,2,4,8 --levels basic,extended,all
"""
from __future__ import annotations

import argparse
import statistics
import time

import onnxruntime as ort
import torch

from benchmarks.common import RESULTS, machine
from cloud_server import model_store
from cloud_server.engine import onnx_llama
from cloud_server.engine.onnx_engine import OnnxEngine, llama_weights
from cloud_server.target import TargetModel
from shared.tree import DraftTree

LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17), parents=(-1, -1, 0, 0, 1, 2, 5, 4))


def forward_s(target: TargetModel, engine: OnnxEngine, caches: list, pending: int,
              tree: DraftTree = TREE) -> float:
    """The seconds of one forward of `tree` after `pending` in every cache through `engine`."""
    jobs = [target.tree_job(cache, pending, tree) for cache in caches]
    start = time.perf_counter()
    engine.run(jobs, ())
    seconds = time.perf_counter() - start
    for cache in caches:
        cache.crop(-(1 + len(tree)))  # back to the prompt: every forward sees one context
    return seconds


def measure(target: TargetModel, level: str, sessions: int, context: int, reps: int
            ) -> dict[str, float]:
    """The build (the first forward's time past a forward's), the share of it spent writing
    the graph rather than in onnxruntime's session setup, and a forward once built."""
    model = target.model
    weights = llama_weights(model, model_store.gguf_of("default"))
    engine = OnnxEngine(model.config, weights, model.get_input_embeddings(),
                        torch.get_num_threads(), LEVELS[level])
    start = time.perf_counter()
    onnx_llama.build(engine.shape, weights, sessions, {}).SerializeToString()
    written = time.perf_counter() - start
    prompts = [[(17 * s + i) % 4000 + 100 for i in range(context)] for s in range(sessions)]
    caches = [target.prefill(prompt)[0] for prompt in prompts]
    first = forward_s(target, engine, caches, 42)
    times = [forward_s(target, engine, caches, 42) for _ in range(reps)]
    step = statistics.median(times)
    return {"build_s": first - step, "graph_s": written, "forward_ms": 1000 * step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="1,2,4,8")
    p.add_argument("--levels", default="basic,extended,all")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    path, model_id = model_store.resolve("default")
    target = TargetModel.load(path, model_id, "cpu", weights="q4",
                              gguf=model_store.gguf_of("default"))
    lines = [f"# {machine()}, {args.context}-token context, 1 + {len(TREE)} tokens a "
             f"session, median of {args.reps} forwards after the build",
             "| sessions | level | build s | of which writing the graph s | forward ms "
             "| forward vs all |", "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    rows = []
    for n in map(int, args.sessions.split(",")):
        cells = {level: measure(target, level, n, args.context, args.reps)
                 for level in args.levels.split(",")}
        base = cells.get("all", next(iter(cells.values())))["forward_ms"]
        for level, cell in cells.items():
            rows.append((n, level, cell))
            lines.append(f"| {n} | {level} | {cell['build_s']:.1f} | {cell['graph_s']:.1f} | "
                         f"{cell['forward_ms']:.1f} | {cell['forward_ms'] / base:.2f}x |")
            print(lines[-1], flush=True)
    (RESULTS / "graph_build.md").write_text("\n".join(lines) + "\n")
    _plot(rows)


def _plot(rows: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (build, step) = plt.subplots(1, 2, figsize=(10, 4))
    for level in dict.fromkeys(level for _, level, _ in rows):
        mine = [(n, cell) for n, lv, cell in rows if lv == level]
        ns = [n for n, _ in mine]
        build.plot(ns, [c["build_s"] for _, c in mine], marker="o", label=level)
        step.plot(ns, [c["forward_ms"] for _, c in mine], marker="o", label=level)
    for ax, ylabel, title in ((build, "graph build (s)", "building the graph"),
                              (step, "forward (ms)", "a forward once built")):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set(xlabel="sessions a forward", ylabel=ylabel, xticks=ns, xticklabels=ns,
               title=title)
    build.legend(title="ORT optimization")
    fig.tight_layout()
    out = RESULTS / "graph_build.png"
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
