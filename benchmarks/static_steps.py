"""Forward time per shape (sessions x tokens a session) on each engine, side by side in one
process on one loaded model: transformers' modules, the static engine eager, and the static
engine replaying CUDA graphs (on CUDA only).

Each cell runs S sessions' jobs of T tokens (a pending token and a bushy tree of T - 1 nodes)
after a prompt of --context tokens, as one `TargetModel.run`, then compacts back, so every
repeat is the same forward; the figure is the median. Also reported: each engine's tree forward
over its one-token step (`--tokens` 65 at 1 session: a tree of 64 nodes, which the issue's
target puts at 1.3 steps at most on a GPU).

    python -m benchmarks.static_steps --device cuda --sessions 1,4,16 --tokens 1,9,17,65
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from cloud_server import model_store
from cloud_server.calibrate import bushy_tree
from cloud_server.device import Device, Precision
from cloud_server.engine.cuda_graphs import Replay
from cloud_server.engine.static_engine import SlotPlan, StaticEngine
from cloud_server.engine.transformers_engine import ModulesEngine
from cloud_server.target import TargetModel, pick_device, pick_dtype

WARM_UP = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="as cloud-server --model")
    p.add_argument("--device", choices=[d.value for d in Device], default=Device.AUTO.value)
    p.add_argument("--dtype", choices=[d.value for d in Precision], default=Precision.AUTO.value)
    p.add_argument("--sessions", default="1,4,16")
    p.add_argument("--tokens", default="1,9,17,65", help="tokens a session: 1 + tree nodes")
    p.add_argument("--context", type=int, default=200, help="prompt tokens before the forward")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--name", default="static_steps")
    args = p.parse_args(argv)
    args.sessions = [int(s) for s in args.sessions.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def engines(target: TargetModel, args: argparse.Namespace) -> dict[str, Any]:
    plan = SlotPlan(max(args.sessions), args.context + max(args.tokens) + 1,
                    max(args.tokens) - 1)
    found: dict[str, Any] = {"transformers": ModulesEngine(target.model, target.device),
                             "static eager": StaticEngine(target.model, target.device, plan,
                                                          None)}
    if target.device.type == "cuda":
        found["static graphs"] = StaticEngine(target.model, target.device, plan, Replay)
    return found


def time_cell(target: TargetModel, sessions: int, tokens: int, args: argparse.Namespace
              ) -> float:
    """Median ms of one forward of `sessions` jobs of `tokens` tokens each."""
    vocab = target.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(args.context)]
    caches = [target.prefill(prompt)[0] for _ in range(sessions)]
    tree = bushy_tree(tokens - 1, vocab)
    samples = []
    for _ in range(WARM_UP + args.repeat):
        jobs = [target.tree_job(cache, prompt[-1], tree) for cache in caches]
        start = time.perf_counter()
        target.run(jobs)
        samples.append(1000 * (time.perf_counter() - start))
        for cache in caches:
            target.keep_path(cache, args.context - 1, ())
    return statistics.median(samples[WARM_UP:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path, model_id = model_store.resolve(args.model)
    base = TargetModel.load(path, model_id, args.device, precision=args.dtype,
                            engine="transformers", onednn=False)
    shapes = [(s, t) for s in args.sessions for t in args.tokens]
    ms: dict[str, dict[tuple[int, int], float]] = {}
    for name, engine in engines(base, args).items():
        target = TargetModel(base.model, base.tokenizer, model_id, base.device, engine)
        engine.prepare([()], max(args.sessions))  # every shape captured before timing
        ms[name] = {}
        for shape in shapes:
            ms[name][shape] = time_cell(target, *shape, args)
            print(f"  {name:>14} {shape[0]:>2} x {shape[1]:<3} {ms[name][shape]:7.2f} ms",
                  file=sys.stderr, flush=True)
    names = list(ms)
    first = names[0]
    body = [(s, t, *(f"{ms[n][s, t]:.2f}" for n in names),
             *(f"{ms[first][s, t] / ms[n][s, t]:.2f}" for n in names[1:]),
             *(f"{ms[n][s, t] / ms[n][s, 1]:.2f}" for n in names if 1 in args.tokens))
            for s, t in shapes]
    header = ("sessions", "tokens a session", *(f"{n} ms" for n in names),
              *(f"{n} speed-up over {first}" for n in names[1:]),
              *(f"{n} x its 1-token step" for n in names if 1 in args.tokens))
    dev = pick_device(Device(args.device))
    text = (f"# Forward time per shape, by engine\n\n{model_id} on {dev} in "
            f"{str(pick_dtype(Precision(args.dtype), dev, path)).split('.')[-1]}; a prompt of "
            f"{args.context} tokens, then one forward of S sessions x T tokens (a pending "
            f"token and a bushy tree of T - 1 nodes), median of {args.repeat} after "
            f"{WARM_UP}; {machine()}\n\n" + markdown_table(header, body) + "\n")
    write_results(args.name, text)
    grouped_bars(RESULTS / f"{args.name}.png", [f"{s} x {t}" for s, t in shapes],
                 {n: [ms[n][shape] for shape in shapes] for n in names}, "ms per forward",
                 f"Forward time by engine, {model_id} on {dev}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
