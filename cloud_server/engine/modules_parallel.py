"""The transformers engine over N ranks (`cloud-server --tensor-parallel N --engine
transformers`): the families the static engine cannot split (sliding windows, soft-capping,
fused projections) split by transformers' own plan (`from_pretrained` with tp_plan "auto"),
which shards each layer as the model's `base_model_tp_plan` says (DTensor over
torch.distributed's default group, gloo on the CPU, NCCL on CUDA).

Rank 0 serves; each forward it sends the other ranks, in one message, the caches made and
dropped since the last, the compactions, and the batch's jobs with their caches by number;
every rank runs the same ModulesEngine.run on its shard (the same rows of logits too, which
the plan gathers), so the ranks reach transformers' collectives in the same order. A session's
DynamicCache holds its rank's KV heads. The ranks' processes and deadlines are ranks.py's, as
for the static engine's split (parallel_engine.py).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.ranks import COLLECTIVE_S, OnLost, Ranks
from cloud_server.engine.transformers_engine import ModulesEngine


def no_plan(config: Any) -> str | None:
    """Why transformers cannot split this model's family; None when it can."""
    if getattr(config, "base_model_tp_plan", None):
        return None
    return f"transformers has no tensor-parallel plan for {config.model_type}"


@dataclass(frozen=True)
class ModulesJob:
    """What every rank builds: the checkpoint at `path` in `dtype`, split by its plan, under
    a ModulesEngine on the rank's device."""

    path: str
    dtype: torch.dtype
    device_type: str
    joins_first: ClassVar[bool] = True  # loading by the plan runs on the group (ranks.py)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def engine(self, rank: int) -> ModulesEngine:
        """Rank `rank`'s engine over its part of the model."""
        device = torch.device("cpu")
        if self.device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=self.dtype, distributed_config=DistributedConfig(tp_plan="auto"))
        return ModulesEngine(model.eval(), device)


@dataclass(frozen=True)
class Job:
    """A ForwardJob as the other ranks run it: its cache by number."""

    cache: int
    ids: tuple[int, ...]
    positions: np.ndarray  # [len(ids)]
    seen: np.ndarray | None  # [len(ids), len(ids)] bool
    rows: range


@dataclass(frozen=True)
class Message:
    """The caches made (number, most positions) and dropped since the last message, the
    compactions (number, base, accepted nodes), then a forward of `jobs`, if any."""

    made: tuple[tuple[int, int | None], ...]
    dropped: tuple[int, ...]
    keeps: tuple[tuple[int, int, tuple[int, ...]], ...]
    jobs: tuple[Job, ...] = ()


class ModulesParallelEngine:
    """Engine (interface.py) of rank 0: its part in `local`, the other ranks behind `ranks`."""

    exact_reference = False  # transformers' generate on rank 0 alone would wait on the others

    def __init__(self, local: ModulesEngine, ranks: Ranks):
        self.local = local
        self.ranks = ranks
        self.batchable = local.batchable
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = itertools.count()
        self._made: list[tuple[int, int | None]] = []
        self._dropped: list[int] = []  # appended to by finalizers, on any thread
        self._keeps: list[tuple[int, int, tuple[int, ...]]] = []

    @classmethod
    def start(cls, job: ModulesJob, ranks: int, threads: int,
              collective_s: float = COLLECTIVE_S, on_lost: OnLost | None = None
              ) -> "ModulesParallelEngine":
        """Starts the other ranks on `job`, then loads rank 0's part beside theirs."""
        if dist.is_initialized():  # the plan runs on the default group: one a process
            raise ValueError("this process already holds a tensor-parallel target split by "
                             "transformers' plan: one a process")
        others = Ranks.start(ranks, job, job.backend, threads, collective_s, on_lost)
        try:
            local = job.engine(0)
        except BaseException:
            others.stop()
            raise
        others.await_loaded()
        return cls(local, others)

    def describe(self) -> str:
        return (f"tensor parallel over {self.ranks.count} ranks ({self.ranks.backend}) by "
                f"transformers' plan, each rank {self.local.describe()}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Over all ranks: the admission's KV budget is the node's."""
        return self.local.kv_bytes_per_token

    def new_cache(self, most_positions: int | None = None) -> Any:
        cache = self.local.new_cache(most_positions)
        number = next(self._next)
        self._numbers[cache] = number
        self._made.append((number, most_positions))
        weakref.finalize(cache, self._dropped.append, number)
        return cache

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Nothing to capture: every forward runs as it comes."""

    def keep_path(self, cache: Any, base: int, accepted_nodes: tuple[int, ...]) -> None:
        self._keeps.append((self._numbers[cache], base, accepted_nodes))
        self.local.keep_path(cache, base, accepted_nodes)

    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        """The layer outputs are whole on every rank after each block's sum: rank 0 alone
        keeps the `capture`d ones."""
        made, self._made = tuple(self._made), []
        dropped = tuple(self._dropped[:])
        del self._dropped[: len(dropped)]
        keeps, self._keeps = tuple(self._keeps), []
        message = Message(made, dropped, keeps, tuple(
            Job(self._numbers[job.cache], job.ids, job.positions, job.seen, job.rows)
            for job in jobs))
        self.ranks.together(message, lambda: self.local.run(jobs, capture))


@dataclass
class ModulesFollower:
    """Rank r > 0: runs each of rank 0's messages on its engine, over its copies of the
    sessions' caches."""

    engine: ModulesEngine
    caches: dict[int, Any]

    def handle(self, message: Message) -> None:
        """In the order rank 0 did them: a cache compacted, then dropped (its session ended)
        before the next forward, comes in one message."""
        for number, most in message.made:
            self.caches[number] = self.engine.new_cache(most)
        for number, base, nodes in message.keeps:
            self.engine.keep_path(self.caches[number], base, nodes)
        for number in message.dropped:
            del self.caches[number]
        if message.jobs:
            self.engine.run([ForwardJob(self.caches[job.cache], job.ids, job.positions,
                                        job.seen, job.rows) for job in message.jobs], ())
