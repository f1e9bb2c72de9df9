"""How batched verification lays out the sessions' KV caches, measured on the real target.

B sessions, each with its own prompt (lengths spread over 100-500 tokens) and a draft tree of N
nodes, verified three ways: one forward per session (no batching); one ragged forward, the
server's layout (cloud_server/engine/ragged.py: all new tokens in one row, attention per session on
its own cache, nothing copied); and one padded batch forward, the layout of transformers'
batched generation (each session's cache copied, left-padded, into a [B, heads, longest, dim]
cache, the new tokens padded to the longest tree, and the new keys and values copied back
after). Median time of 5 runs; ratios against one forward per session.

    python -m benchmarks.batch_layout
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table
from cloud_server import model_store
from cloud_server.calibrate import bushy_tree
from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.kv_cache import keep_path
from cloud_server.target import TargetModel


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="1,2,4,8,16")
    p.add_argument("--nodes", default="1,8,32")
    p.add_argument("--repeat", type=int, default=5)
    return p.parse_args()


@torch.inference_mode()
def padded(target: TargetModel, jobs: list[ForwardJob]) -> None:
    """One forward over a padded copy of the caches; the new entries copied back after."""
    cached = [job.cache.get_seq_length() for job in jobs]
    longest, widest = max(cached), max(len(job.ids) for job in jobs)
    batch = DynamicCache(config=target.model.config)
    for layer in range(len(jobs[0].cache.layers)):
        parts = []
        for name in ("keys", "values"):
            states = [getattr(job.cache.layers[layer], name) for job in jobs]
            padded_states = states[0].new_zeros((len(jobs), *states[0].shape[1:2], longest,
                                                 states[0].shape[-1]))
            for i, s in enumerate(states):
                padded_states[i, :, longest - s.shape[2]:] = s[0]
            parts.append(padded_states)
        batch.update(parts[0], parts[1], layer)
    ids = torch.zeros((len(jobs), widest), dtype=torch.long)
    positions = torch.zeros((len(jobs), widest), dtype=torch.long)
    allowed = np.zeros((len(jobs), widest, longest + widest), dtype=bool)
    for i, (job, length) in enumerate(zip(jobs, cached)):
        q = len(job.ids)
        ids[i, :q] = torch.tensor(job.ids)
        positions[i, :q] = torch.from_numpy(job.positions)
        assert job.seen is not None
        allowed[i, :q, longest - length: longest] = True
        allowed[i, :q, longest: longest + q] = job.seen
        allowed[i, q:, longest] = True  # padding rows see something (no NaN), used by no one
    mask = torch.zeros(allowed.shape, dtype=target.model.dtype)
    mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(target.model.dtype).min)
    target.model(input_ids=ids, attention_mask=mask[:, None], position_ids=positions,
                 past_key_values=batch, use_cache=True)
    for i, job in enumerate(jobs):
        q = len(job.ids)
        for layer, own in zip(batch.layers, job.cache.layers):
            own.update(layer.keys[i: i + 1, :, longest: longest + q],
                       layer.values[i: i + 1, :, longest: longest + q])


def sessions_with_trees(target: TargetModel, sessions: int, nodes: int
                        ) -> tuple[Callable[[], list[ForwardJob]], Callable[[], None]]:
    """`sessions` prefilled sessions (random prompts of 100-500 tokens): a function giving
    each session's job verifying a tree of `nodes`, and one rewinding them to the prompt."""
    rng = np.random.default_rng(sessions * 100 + nodes)
    vocab = target.vocab_size
    prompts = [[int(t) for t in rng.integers(100, vocab, int(n))]
               for n in np.linspace(100, 500, sessions)]
    caches = [target.prefill(p)[0] for p in prompts]
    trees = [bushy_tree(nodes) for _ in prompts]

    def jobs() -> list[ForwardJob]:
        return [target.tree_job(c, p[-1], t) for c, p, t in zip(caches, prompts, trees)]

    def rewind() -> None:  # back to the prompt alone
        for cache, prompt in zip(caches, prompts):
            keep_path(cache, len(prompt) - 1, ())

    return jobs, rewind


def measure(target: TargetModel, sessions: int, nodes: int, repeat: int) -> dict[str, float]:
    jobs, rewind = sessions_with_trees(target, sessions, nodes)
    ways = {"one per session": lambda: [target.run([job]) for job in jobs()],
            "ragged (ours)": lambda: target.run(jobs()),
            "padded copy": lambda: padded(target, jobs())}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(repeat + 1):  # the first round builds kernels
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            if r:
                times[name].append(1000 * (time.perf_counter() - start))
            rewind()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    args = parse_args()
    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    rows, groups, series = [], [], {"ragged (ours)": [], "padded copy": []}
    for nodes in (int(n) for n in args.nodes.split(",")):
        for sessions in (int(b) for b in args.sessions.split(",")):
            ms = measure(target, sessions, nodes, args.repeat)
            alone = ms["one per session"]
            rows.append([sessions, nodes, f"{alone:.0f}", f"{ms['ragged (ours)']:.0f}",
                         f"{alone / ms['ragged (ours)']:.2f}x", f"{ms['padded copy']:.0f}",
                         f"{alone / ms['padded copy']:.2f}x"])
            groups.append(f"{sessions}x{nodes}")
            for name in series:
                series[name].append(alone / ms[name])
            print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
    table = markdown_table(["sessions", "tree nodes", "one per session ms", "ragged ms",
                            "ragged speed-up", "padded ms", "padded speed-up"], rows)
    (RESULTS / "batch_layout.md").write_text(
        f"# {__doc__.splitlines()[0]}\n\n{machine()}\n\n{table}\n")
    grouped_bars(RESULTS / "batch_layout.png", groups, series,
                 "speed-up over one forward per session", "Batched verification: cache layout "
                 "(sessions x tree nodes)", baseline=1.0)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
