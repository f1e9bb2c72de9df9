"""The static engine over N ranks (`cloud-server --tensor-parallel N`): rank 0's engine, and
what the other ranks run for each of its messages.

Rank 0 serves the sessions; each forward it sends the batch's jobs (each session's slot, cached
length, tokens, positions and tree mask) to the other ranks in one message, then every rank runs
the same StaticEngine.run on its shard (tensor_parallel.py): the same cut into forwards, the
same buckets and captured shapes, so the ranks reach the same collectives in the same order.
Rank 0 alone reads the logits and the captured layer outputs, which the last all-reduce left
whole on it; the other ranks' copies of the jobs ask for neither. A compaction moves entries on
every rank, so it rides with the next message; the K/V a drafter reads from the cache
(`SlotCache.layers`) are gathered from the ranks on rank 0. The ranks' processes and deadlines
are ranks.py's; vLLM V1 lays out the same way (one process serving, one worker per GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
import torch.distributed as dist

from cloud_server.engine.cuda_graphs import Rehearsal, Replay
from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.kv_slots import SlotCache, SlotLayer, moves
from cloud_server.engine.ranks import COLLECTIVE_S, Group, OnLost, Ranks
from cloud_server.engine.static_engine import SlotPlan, StaticEngine
from cloud_server.engine.static_llama import StaticLlama
from cloud_server.engine.tensor_parallel import Read, all_reduce, shard
from shared.errors import SplitDecodingError


_TO_RANK_0 = dist.GatherOptions()
_TO_RANK_0.rootRank = 0


@dataclass(frozen=True)
class ShardJob:
    """What every rank builds: the checkpoint at `path` in `dtype`, its shard on the rank's
    device, and a StaticEngine over it with rank 0's slots and graphs."""

    path: str
    dtype: torch.dtype
    device_type: str
    plan: SlotPlan
    graphs: type[Replay] | type[Rehearsal] | None
    pad: bool
    joins_first: ClassVar[bool] = False  # a rank loads its part, then joins (ranks.py)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")

    def shard(self, model: Any, rank: int, ranks: int, read: Read | None = None
              ) -> StaticLlama:
        """Rank `rank`'s weights on its device, read by `read` (tensor_parallel.shard); their
        sums join the group in `engine`."""
        return shard(model, rank, ranks, lambda whole: whole, self.device(rank), read)

    def engine(self, model: Any, rank: int, group: Group, net: StaticLlama | None = None
               ) -> StaticEngine:
        """The rank's engine over `net` (None: its shard of `model`'s own weights)."""
        net = replace(net or self.shard(model, rank, group.size()), reduce=all_reduce(group))
        return StaticEngine(model, self.device(rank), self.plan, self.graphs, self.pad, net=net)


@dataclass(frozen=True)
class Job:
    """A ForwardJob as the other ranks run it: where its session's K/V lives and what it adds."""

    slot: int
    cached: int
    ids: tuple[int, ...]
    positions: np.ndarray  # [len(ids)]
    seen: np.ndarray | None  # [len(ids), len(ids)] bool

    @classmethod
    def of(cls, job: ForwardJob) -> "Job":
        return cls(job.cache.slot, job.cache.length, job.ids, job.positions, job.seen)


@dataclass(frozen=True)
class Keep:
    """A compaction (Engine.keep_path) of `slot`."""

    slot: int
    base: int
    accepted_nodes: tuple[int, ...]


@dataclass(frozen=True)
class Message:
    """One message to the other ranks: the compactions since the last, then a forward of
    `jobs` (none: `gather` or `prepare` instead)."""

    keeps: tuple[Keep, ...]
    jobs: tuple[Job, ...] = ()
    capture: tuple[int, ...] = ()
    gather: tuple[int, int] | None = None  # (slot, length) whose K/V rank 0 reads
    prepare: tuple[tuple[tuple[int, ...], ...], int] | None = None  # Engine.prepare's arguments


class TensorParallelEngine:
    """Engine (interface.py) of rank 0: its shard in `local`, the other ranks behind
    `ranks`."""

    batchable = True
    exact_reference = False

    def __init__(self, local: StaticEngine, ranks: Ranks):
        self.local = local
        self.ranks = ranks
        self._keeps: list[Keep] = []

    @classmethod
    def start(cls, model: Any, job: ShardJob, ranks: int, threads: int,
              collective_s: float = COLLECTIVE_S, on_lost: OnLost | None = None
              ) -> "TensorParallelEngine":
        """Starts the other ranks on `job` and builds rank 0's shard of `model` (loaded
        from `job.path`)."""
        others = Ranks.start(ranks, job, job.backend, threads, collective_s, on_lost)
        return cls(job.engine(model, 0, others.group), others)

    def describe(self) -> str:
        return (f"tensor parallel over {self.ranks.count} ranks ({self.ranks.backend}), each "
                f"rank a "
                f"{self.local.describe()}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Over all ranks: the admission's KV budget is the node's."""
        return self.local.kv_bytes_per_token

    def new_cache(self, most_positions: int | None = None) -> "GatheredCache":
        return GatheredCache(self.local.new_cache(most_positions), self._gather)

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        self.ranks.together(Message(self._taken(), prepare=(tuple(captures), sessions)),
                     lambda: self.local.prepare(captures, sessions))

    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        message = Message(self._taken(), tuple(Job.of(job) for job in jobs), capture)
        self.ranks.together(message, lambda: self.local.run(jobs, capture))

    def keep_path(self, cache: Any, base: int, accepted_nodes: tuple[int, ...]) -> None:
        if moves(accepted_nodes):
            self._keeps.append(Keep(cache.slot, base, accepted_nodes))
        self.local.keep_path(cache, base, accepted_nodes)

    def _gather(self, slot: int, length: int) -> torch.Tensor:
        """[2, layers, kv_heads, length, head_dim]: the slot's K/V of every rank's heads."""
        mine = self.local.pool.kv[:, :, slot, :, :length].contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.ranks.count)]
        self.ranks.together(Message(self._taken(), gather=(slot, length)),
                     lambda: self.ranks.group.gather([parts], [mine], _TO_RANK_0).wait())
        return torch.cat(parts, dim=2)

    def _taken(self) -> tuple[Keep, ...]:
        keeps, self._keeps = tuple(self._keeps), []
        return keeps


class GatheredCache:
    """A session's SlotCache on rank 0, whose `layers` (what a drafter reads of the cache)
    hold every rank's KV heads."""

    def __init__(self, own: SlotCache, gather: Any):
        self.own = own
        self._gather = gather

    @property
    def slot(self) -> int:
        return self.own.slot

    @property
    def length(self) -> int:
        return self.own.length

    @length.setter
    def length(self, value: int) -> None:
        self.own.length = value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.own.length

    @property
    def layers(self) -> list[SlotLayer]:
        kv = self._gather(self.own.slot, self.own.length)[:, :, None]
        return [SlotLayer(kv[0, i], kv[1, i]) for i in range(kv.shape[1])]


@dataclass(frozen=True)
class Follower:
    """Rank r > 0: runs each of rank 0's messages on its engine."""

    engine: StaticEngine
    group: Group

    @torch.inference_mode()
    def handle(self, message: Message) -> None:
        pool = self.engine.pool
        for keep in message.keeps:
            pool.keep_path(SlotCache(pool, keep.slot), keep.base, keep.accepted_nodes)
        if message.prepare is not None:
            self.engine.prepare(*message.prepare)
        if message.gather is not None:
            slot, length = message.gather
            mine = pool.kv[:, :, slot, :, :length].contiguous()
            self.group.gather([], [mine], _TO_RANK_0).wait()
        if message.jobs:
            try:
                self.engine.run([self._job(job) for job in message.jobs], message.capture)
            except SplitDecodingError:  # rank 0 refuses it to its session at the same point
                pass

    def _job(self, job: Job) -> ForwardJob:
        cache = SlotCache(self.engine.pool, job.slot)
        cache.length = job.cached
        return ForwardJob(cache, job.ids, job.positions, job.seen, range(0))
