"""The static engine: the target's forwards as static shapes over preallocated KV slots, each
shape replayed from a CUDA graph on a GPU (DESIGN 7a; gpt-fast's style, vLLM's padding to
capture sizes).

A batch of jobs is cut into forwards of one token bucket each (a prompt chunk does not pad the
decoding steps beside it to its length) and at most the largest session bucket. Each forward
is S rows of T tokens; a row is a session's job, padded with tokens that write to the pool's
scratch slot and see only key 0. With graphs, S, T and the context are padded up to a captured
bucket (buckets.py); a forward beyond every bucket, which with the server's buckets is a prompt
chunk longer than the largest tree, runs eagerly at its own shape (once a chunk, where a
decoding step replays a graph every token). Without graphs (the CPU) every forward runs eagerly
at its own shape, unpadded.

The logits are computed outside the graph for the wanted rows alone (a prompt chunk wants one
row of its 256), from the final hidden states the forward leaves.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cloud_server.engine.buckets import Buckets, Shape
from cloud_server.engine.cuda_graphs import Rehearsal, Replay, capture_or_none
from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.kv_slots import SlotCache, SlotPool
from cloud_server.engine.static_llama import StaticLlama, pack
from cloud_server.engine.transformers_engine import kv_elements_per_token
from shared.errors import Overloaded


@dataclass(frozen=True)
class SlotPlan:
    """How many sessions the pool holds, of how many positions each, and the largest tree."""

    sessions: int
    positions: int
    most_tree_nodes: int


@dataclass
class _Inputs:
    ints: torch.Tensor  # packed (static_llama.pack)
    tree: torch.Tensor  # [S, T, T] bool


class StaticEngine:
    batchable = True
    exact_reference = False

    def __init__(self, model: Any, device: torch.device, plan: SlotPlan,
                 graphs: type[Replay] | type[Rehearsal] | None, pad: bool | None = None,
                 buckets: Buckets | None = None, net: StaticLlama | None = None):
        """`graphs`: Replay (CUDA graphs), Rehearsal (their contract on the CPU, tests) or
        None (eager). `pad`: pad forwards to the buckets (default: with graphs). `buckets`:
        the forward shapes (default: the server's, for `plan`). `net`: the math over
        `model`'s weights (default: all of them; a rank's shard under tensor parallelism),
        whose heads the KV slots hold."""
        self.config = config = model.config
        self.net = net or StaticLlama.of(model)
        self.device = device
        self.plan = plan
        self.pool = SlotPool(config.num_hidden_layers, self.net.kv_heads, self.net.head_dim,
                             plan.sessions, plan.positions, self.net.dtype, device)
        self.buckets = buckets or Buckets.up_to(plan.most_tree_nodes, plan.positions,
                                                plan.sessions)
        self._graph_kind = graphs
        self._pad = graphs is not None if pad is None else pad
        self._graphs: dict[tuple[Shape, tuple[int, ...]], Replay | Rehearsal | None] = {}
        self._graph_pool = (torch.cuda.graph_pool_handle()
                            if graphs is Replay else None)

    def describe(self) -> str:
        graphs = {Replay: "CUDA graphs", Rehearsal: "rehearsed graphs", None: "eager"}
        return (f"static engine, {graphs[self._graph_kind]}, "
                f"{str(self.net.dtype).split('.')[-1]}, {self.plan.sessions} KV slots of "
                f"{self.plan.positions} positions ({self.pool.bytes / 2**30:.2f} GiB)")

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_elements_per_token(self.config) * self.pool.kv.element_size()

    def new_cache(self, most_positions: int | None = None) -> SlotCache:
        return self.pool.take(most_positions)

    def keep_path(self, cache: SlotCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
        self.pool.keep_path(cache, base, accepted_nodes)

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Captures, for each set of layers to capture, every bucket a forward of up to
        `sessions` sessions may use, now rather than in the first forwards that need them; a
        forward of more sessions captures its bucket when it first comes."""
        if self._graph_kind is None:
            return
        b = self.buckets
        most = b.sessions_for(sessions)
        shapes = [shape for shape in b.all if shape.sessions <= most]
        later = (f"forwards of {_listed(s for s in b.sessions if s > most)} sessions capture "
                 "theirs when they first come; " if most < b.sessions[-1] else "")
        layers = ", ".join(_listed(capture) if capture else "none" for capture in captures)
        print(f"static engine: capturing {len(shapes) * len(captures)} forward shapes "
              f"(sessions {_listed(s for s in b.sessions if s <= most)} x tokens "
              f"{_listed(b.tokens)} x positions {_listed(b.contexts)} x layer outputs "
              f"{layers}; {later}prompt chunks past {b.tokens[-1]} tokens run eagerly) ...",
              file=sys.stderr, flush=True)
        for capture in captures:
            for shape in shapes:
                self._graph(shape, capture)

    @torch.inference_mode()
    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        groups: dict[int, list[ForwardJob]] = {}
        for job in jobs:
            tokens = self.buckets.tokens_for(len(job.ids)) or len(job.ids)
            groups.setdefault(tokens, []).append(job)
        most = self.buckets.sessions[-1]
        for group in groups.values():
            for start in range(0, len(group), most):
                self._forward(group[start: start + most], capture)
        if self.device.type == "cuda":  # the batcher times the forward: wait for it
            torch.cuda.synchronize(self.device)

    def _forward(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        rows = len(jobs)
        tokens = max(len(job.ids) for job in jobs)
        context = max(_cached(job) + len(job.ids) for job in jobs)
        shape = self.buckets.fit(rows, tokens, context) if self._pad else None
        size = shape or Shape(rows, tokens, context)
        inputs = self._inputs(jobs, size)
        graph = None if shape is None else self._graph(shape, capture)
        if graph is None:
            final, hidden = self.net.forward(self.pool.kv, inputs.ints.to(self.device),
                                             inputs.tree.to(self.device), size.context, capture)
        else:
            final, hidden = graph(inputs.ints, inputs.tree)
        self._hand_out(jobs, size.tokens, final, hidden)

    def _inputs(self, jobs: Sequence[ForwardJob], shape: Shape) -> _Inputs:
        """Each job a row; the rows past them and the tokens past each job are padding."""
        S, T = shape.sessions, shape.tokens
        ids = np.zeros((S, T), dtype=np.int64)
        pos = np.zeros((S, T), dtype=np.int64)
        write_slot = np.full((S, T), self.pool.scratch, dtype=np.int64)
        write_at = np.tile(np.arange(T, dtype=np.int64), (S, 1))
        read_slot = np.full(S, self.pool.scratch, dtype=np.int64)
        cached = np.zeros(S, dtype=np.int64)
        tree = np.zeros((S, T, T), dtype=bool)
        for b, job in enumerate(jobs):
            cache: SlotCache = job.cache
            n, c = len(job.ids), cache.length
            if c + n > self.pool.positions:
                raise Overloaded(f"a session reached its KV slot's {self.pool.positions} "
                                 "positions")
            ids[b, :n], pos[b, :n] = job.ids, job.positions
            write_slot[b, :n], write_at[b, :n] = cache.slot, c + np.arange(n)
            read_slot[b], cached[b] = cache.slot, c
            tree[b, :n, :n] = np.tri(n, dtype=bool) if job.seen is None else job.seen
        ints = pack(*(torch.from_numpy(a) for a in (ids, pos, write_slot, write_at, read_slot,
                                                     cached)))
        return _Inputs(ints, torch.from_numpy(tree))

    def _hand_out(self, jobs: Sequence[ForwardJob], T: int, final: torch.Tensor,
                  hidden: torch.Tensor | None) -> None:
        """Logits of the wanted rows, captured layers, and the caches' new lengths. `final`
        [S * T, width] and `hidden` [S * T, L, width] are overwritten by the next replay:
        everything taken from them here is a copy."""
        keep = np.concatenate([b * T + np.asarray(job.rows, dtype=np.int64)
                               for b, job in enumerate(jobs)])
        wanted = final[torch.from_numpy(keep).to(self.device)]  # [rows, width]
        logits = F.linear(wanted, self.net.head).float().split([len(job.rows) for job in jobs])
        for b, job in enumerate(jobs):
            job.logits = logits[b]
            job.hidden = (hidden[b * T: b * T + len(job.ids)].clone()
                          if hidden is not None and job.capture else None)
            job.cache.length += len(job.ids)

    def _graph(self, shape: Shape, capture: tuple[int, ...]) -> Replay | Rehearsal | None:
        key = (shape, capture)
        if key not in self._graphs:
            kind = self._graph_kind
            if kind is None:
                return None
            inputs = self._inputs([], shape)
            kv, net = self.pool.kv, self.net

            def step(ints: torch.Tensor, tree: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
                return net.forward(kv, ints, tree, shape.context, capture)

            self._graphs[key] = capture_or_none(kind, step, inputs.ints.to(self.device),
                                                inputs.tree.to(self.device), self._graph_pool,
                                                shape)
        return self._graphs[key]


def _listed(sizes: Iterable[int]) -> str:
    return "/".join(str(size) for size in sizes)


def _cached(job: ForwardJob) -> int:
    return job.cache.get_seq_length()
