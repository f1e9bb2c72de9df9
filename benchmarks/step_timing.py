"""Step times the benchmarks set side by side: the target's plain decoding step as the server
runs it, and one call of the edge drafter's step graph."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from cloud_server.calibrate import PREFIX_TOKENS
from shared.drafter_bundle import Graph, Precision, StepIO
from shared.tree import DraftTree

WARM_UP = 3  # first calls of a shape build kernels (oneDNN's primitives): kept out of the figure


def plain_step_ms(target, repeat: int = 9) -> float:
    """A decoding step as the server's plain API runs it: one token after a PREFIX_TOKENS
    prefix, the median of `repeat` after the warm-up (docs/performance.md)."""
    cache, _ = target.prefill(list(range(100, 100 + PREFIX_TOKENS)))
    samples = []
    for _ in range(WARM_UP + repeat):
        start = time.perf_counter()
        target.forward_tree(cache, 42, DraftTree((), ()))
        samples.append(1000 * (time.perf_counter() - start))
        target.keep_path(cache, PREFIX_TOKENS - 1, ())  # drop the step's token
    return statistics.median(samples[WARM_UP:])


def target_device(target) -> str:
    import torch

    if target.device.type != "cuda":
        return str(target.device)
    return f"{target.device} ({torch.cuda.get_device_name(target.device)})"


def edge_step_ms(bundle: Path, precision: Precision, queries: int, context: int = 300,
                 repeat: int = 20) -> float:
    """One call of the edge's step graph: `queries` tree nodes after `context` committed
    tokens, all of them verified (one onnxruntime thread, as the drafter runs it)."""
    import onnxruntime as ort

    from edge_client.drafters.moa_bundle import load_manifest

    manifest = load_manifest(bundle)
    c = manifest.config
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle / manifest.graph(precision, Graph.STEP)), options)
    state = np.zeros((manifest.state_heads, context, c["head_dim"]), dtype=np.float32)
    memory = np.zeros((c["kv_heads"], context, c["head_dim"]), dtype=np.float32)
    inputs: tuple[np.ndarray, ...] = (
        np.arange(queries, dtype=np.int64) + 100, np.full(queries, context, dtype=np.int64),
        state, state, np.ones((queries, context + queries), dtype=bool), memory, memory)
    if manifest.recurrent:
        inputs += (np.zeros((queries, c["width"]), dtype=np.float32),)
    feed = dict(zip(StepIO.inputs(manifest.recurrent), inputs))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feed)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)
