"""One forward shape captured as a CUDA graph and replayed.

A replay runs the captured kernels on the same memory: inputs are copied into the graph's own
input tensors, and its outputs are the same tensors every time, overwritten by the next replay,
so a caller reads (copies out) what it needs before it replays again. All graphs share one
memory pool: they never run at once and their outputs are consumed at once, so one graph's
temporaries may reuse another's (torch.cuda.graphs, "Graph memory management").

`Rehearsal` keeps the same contract on the CPU (static inputs copied in, outputs overwritten by
the next call) so that the tests catch a caller that reads outputs late.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
WARM_UP_RUNS = 2  # eager runs on a side stream before capture (cuBLAS picks its kernels)


class Replay:
    """`step(ints, tree)` captured at the shapes of `ints` and `tree`."""

    def __init__(self, step: Step, ints: torch.Tensor, tree: torch.Tensor,
                 pool: Any):
        self.ints, self.tree = ints.clone(), tree.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_RUNS):
                step(self.ints, self.tree)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = step(self.ints, self.tree)

    def __call__(self, ints: torch.Tensor, tree: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ints.copy_(ints, non_blocking=True)
        self.tree.copy_(tree, non_blocking=True)
        self.graph.replay()
        return self.outputs


class Rehearsal:
    """Replay's contract without a GPU: the step runs eagerly on fixed tensors."""

    def __init__(self, step: Step, ints: torch.Tensor, tree: torch.Tensor,
                 pool: Any):
        self.step, self.ints, self.tree = step, ints.clone(), tree.clone()
        self.outputs = step(self.ints, self.tree)

    def __call__(self, ints: torch.Tensor, tree: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ints.copy_(ints)
        self.tree.copy_(tree)
        for kept, fresh in zip(self.outputs, self.step(self.ints, self.tree)):
            if kept is not None and fresh is not None:
                kept.copy_(fresh)
        return self.outputs


_failures: list[str] = []


def capture_or_none(kind: type[Replay] | type[Rehearsal], step: Step, ints: torch.Tensor,
                    tree: torch.Tensor, pool: Any, shape: object
                    ) -> Replay | Rehearsal | None:
    """The captured step, or None (with one line) where capture fails: it then runs eagerly."""
    try:
        return kind(step, ints, tree, pool)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
        _failures.append(f"{shape}: {err}")
        print(f"static engine: capturing {shape} failed, it runs eagerly: {err}",
              file=sys.stderr, flush=True)
        return None


def failed_captures() -> tuple[str, ...]:
    """Every capture that failed in this process so far, in order, each as the shape and the
    error: right but at eager speed, which no output shows, so a check (the tests' conftest)
    fails on any."""
    return tuple(_failures)
