"""A rank r > 0 of a tensor-parallel target, started by rank 0 (ranks.py) as
`python -m cloud_server.engine.rank_worker`: it reads its spec on stdin and builds its part.
The static engine's reads its shard from the checkpoint a slice at a time (checkpoint_slices.py;
a checkpoint that does not hold every weight under the model's own names is loaded whole, then
cut) and joins the group; the transformers engine's joins first and loads by the model's plan
(modules_parallel.py). Then it runs rank 0's messages until its pipe ends. A collective that
fails (a rank gone, or past its deadline) ends it with one line and code 1; rank 0 sees the
exit."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from cloud_server.engine.checkpoint_slices import CheckpointSlices
from cloud_server.engine.modules_parallel import ModulesFollower, ModulesJob
from cloud_server.engine.parallel_engine import Follower, ShardJob
from cloud_server.engine.ranks import (
    RankSpec, follow, join, loaded_key, rank_store, use_loopback,
)
from cloud_server.engine.tensor_parallel import Read, shard_names


def skeleton(job: ShardJob) -> tuple[Any, Read | None]:
    """The model's modules on the meta device (no weights) and the checkpoint's slices to
    read them from; else, for a checkpoint stored under other names or formats, the model
    loaded whole (None: it reads its own)."""
    config = AutoConfig.from_pretrained(job.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=job.dtype)
    try:
        slices = CheckpointSlices(Path(job.path))
        missing = slices.missing(shard_names(model))
    except FileNotFoundError as err:
        missing = [str(err)]
    if missing:
        print(f"tensor parallel: the checkpoint lacks {missing[0]} (and {len(missing) - 1} "
              "more) by the model's names: this rank loads it whole", file=sys.stderr,
              flush=True)
        return AutoModelForCausalLM.from_pretrained(job.path, dtype=job.dtype).eval(), None
    body = model.model
    body.rotary_emb = type(body.rotary_emb)(config=config)  # computed, not stored
    return model, slices.read


def static_follower(spec: RankSpec, store: TCPStore) -> Follower:
    """The static engine's rank: its shard read, then the group joined."""
    job: ShardJob = spec.job
    model, read = skeleton(job)
    net = job.shard(model, spec.rank, spec.ranks, read)  # before the collectives' deadlines
    store.set(loaded_key(spec.rank), "1")
    group = join(store, spec.rank, spec.ranks, job.backend, spec.collective_s)
    return Follower(job.engine(model, spec.rank, group, net), group)


def modules_follower(spec: RankSpec, store: TCPStore) -> ModulesFollower:
    """The transformers engine's rank: the default group joined, then its part loaded by the
    model's plan (which runs on the group)."""
    job: ModulesJob = spec.job
    join(store, spec.rank, spec.ranks, job.backend, spec.collective_s, default=True)
    follower = ModulesFollower(job.engine(spec.rank), {})
    store.set(loaded_key(spec.rank), "1")
    return follower


def main() -> int:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    torch.set_num_threads(spec.threads)
    transformers_logging.disable_progress_bar()  # rank 0 showed its own
    use_loopback()
    store = rank_store(spec.store_port)
    follower: Follower | ModulesFollower = (
        modules_follower(spec, store) if isinstance(spec.job, ModulesJob)
        else static_follower(spec, store))
    try:
        follow(sys.stdin.buffer, follower.handle)
    except RuntimeError as err:  # a collective failed: the group is gone
        print(f"tensor parallel: rank {spec.rank} of {spec.ranks} stops: {err}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
