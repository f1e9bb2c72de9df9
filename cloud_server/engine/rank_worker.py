"""A rank r > 0 of a tensor-parallel target, started by rank 0 (ranks.py) as
`python -m cloud_server.engine.rank_worker`: it reads its spec on stdin, loads the checkpoint,
keeps its shard and drops the rest, joins the group, then runs rank 0's messages
(parallel_engine.Follower) until its pipe ends. A collective that fails (a rank gone, or past
its deadline) ends it with one line and code 1; rank 0 sees the exit."""
from __future__ import annotations

import pickle
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from cloud_server.engine.parallel_engine import Follower, ShardJob
from cloud_server.engine.ranks import RankSpec, join, loaded_key, rank_store, use_loopback


def main() -> int:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    job: ShardJob = spec.job
    torch.set_num_threads(spec.threads)
    transformers_logging.disable_progress_bar()  # rank 0 showed its own
    use_loopback()
    store = rank_store(spec.store_port)
    model = AutoModelForCausalLM.from_pretrained(job.path, dtype=job.dtype).eval()
    store.set(loaded_key(spec.rank), "1")
    group = join(store, spec.rank, spec.ranks, job.backend, spec.collective_s)
    follower = Follower(job.engine(model, spec.rank, group), group)
    del model  # the shard holds copies of its slices
    try:
        follower.serve(sys.stdin.buffer)
    except RuntimeError as err:  # a collective failed: the group is gone
        print(f"tensor parallel: rank {spec.rank} of {spec.ranks} stops: {err}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
