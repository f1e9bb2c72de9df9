"""`--tensor-parallel --engine transformers` with a target of its own each (transformers'
plan runs on torch.distributed's default group, one a process): a family the static engine
cannot run (Mistral's sliding window) splits as well, and a rank that dies ends every later
forward Unavailable."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from cloud_server.reference import plain_greedy
from cloud_server.target import TargetModel
from shared.errors import Unavailable
from shared.tree import DraftTree
from testkit.target_families import build_family

pytestmark = pytest.mark.slow  # each engine starts a rank: seconds, more on a busy machine

TREE = DraftTree(tokens=(10, 11, 12), parents=(-1, 0, 0))


def test_a_family_the_static_engine_cannot_run_is_split_too(tmp_path):
    path = build_family("mistral", tmp_path / "mistral")
    threads = torch.get_num_threads()
    split = TargetModel.load(str(path), "mistral-tp", "cpu", ranks=2, engine="transformers")
    one = TargetModel.load(str(path), "mistral-one", "cpu", engine="transformers")
    try:
        prompt = list(range(30, 60))  # past the sliding window of 8
        assert plain_greedy(split, prompt, 24) == plain_greedy(one, prompt, 24)
    finally:
        split.engine.ranks.stop()
        torch.set_num_threads(threads)


def test_a_rank_that_dies_ends_every_later_forward_unavailable(tiny_model_dir):
    lost: list[str] = []
    split = TargetModel.load(str(tiny_model_dir), "tiny-tp", "cpu", ranks=2,
                             engine="transformers", on_rank_lost=lost.append)
    rank1 = split.engine.ranks.procs[0]
    os.kill(rank1.pid, signal.SIGKILL)
    assert rank1.wait(10) == -signal.SIGKILL
    for _ in range(2):
        with pytest.raises(Unavailable, match="rank 1 of 2 was killed .*server is stopping"):
            split.forward_tree(split.new_cache(), 30, TREE)
    assert len(lost) == 1
    split.engine.ranks.stop()
