"""Where the tests run the target: the CPU, or what SPLITDEC_TEST_DEVICE names.

On a GPU node, `SPLITDEC_TEST_DEVICE=cuda` runs the same equivalence tests (batched sessions
against each alone, split and server-side speculation against plain greedy decoding, the
precisions of `--dtype`) on CUDA: docs/usage.md, "On a GPU node". `cpu-graphs` is its stand-in
on the CPU: the target loads with `--cuda-graphs rehearse`, so it runs through the engine CUDA
picks (the static engine, forwards padded to the buckets, every shape captured through the
same path) with each graph run eagerly under the graphs' contract. CI runs them on the CPU.
Knows nothing of torch until a target is loaded (the edge's tests import it).
"""
from __future__ import annotations

import os
from typing import Any

STAND_IN = "cpu-graphs"
NAME = os.environ.get("SPLITDEC_TEST_DEVICE", "cpu")
REHEARSED = NAME == STAND_IN
DEVICE = "cpu" if REHEARSED else NAME  # where the target's tensors live
GRAPHS = "rehearse" if REHEARSED else "auto"  # cloud-server --cuda-graphs
SERVER_FLAGS = ("--device", DEVICE, "--cuda-graphs", GRAPHS)  # a cloud-server process's


def load_target(path: str, model_id: str, **options: Any) -> Any:
    """TargetModel.load on the device under test, its engine picked as there."""
    from cloud_server.target import TargetModel

    return TargetModel.load(path, model_id, DEVICE, graphs=GRAPHS, **options)
