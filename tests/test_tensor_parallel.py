"""`--tensor-parallel`: the static engine split over 2 ranks (gloo, fp32; rank 1 a child
process) on the tiny Llama (4 heads, 2 KV heads, one of each a rank) gives what one process
gives: tree forwards, compaction, batched sessions with pads, the layer outputs and cache K/V a
drafter reads (within fp32 rounding), plain decoding, server-side speculation and split
decoding through the server (token for token, up to the near-tie rule); eagerly and padded
under the CUDA graphs' contract. A rank that dies or hangs ends every later forward with
Unavailable, within the collectives' deadline, and leaves no rank behind."""
from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cloud_server.engine.parallel_engine import ShardJob, TensorParallelEngine
from cloud_server.engine.static_engine import SlotPlan
from cloud_server.engine.tensor_parallel import fitting_sizes, unfit
from cloud_server.target import TargetModel
from shared.drafting.base import DrafterName
from shared.errors import Overloaded, Unavailable
from shared.tree import DraftTree
from testkit.tree_checks import assert_tree_forward_is_per_path
from tests.parallel_checks import (
    LIMITS, PROMPT, ROUNDING, TREE, assert_batch_of_every_shape_matches,
    assert_batched_generations_match, assert_drafter_rows_match, assert_split_server_matches,
)

pytestmark = pytest.mark.slow  # each engine starts a rank: seconds, more on a busy machine



@pytest.fixture(scope="module", params=["rehearsed", "eager"])
def pair(request: pytest.FixtureRequest, tiny_model_dir):
    """(one process's static engine, the same over 2 ranks), both eager or both padded to the
    buckets under the graphs' contract."""
    graphs = "rehearse" if request.param == "rehearsed" else "off"
    threads = torch.get_num_threads()
    load = dict(engine="static", graphs=graphs, limits=LIMITS)
    split = TargetModel.load(str(tiny_model_dir), "tiny-tp", "cpu", ranks=2, **load)
    one = TargetModel.load(str(tiny_model_dir), "tiny-one", "cpu", **load)
    yield one, split
    split.engine.ranks.stop()
    torch.set_num_threads(threads)


def test_a_tree_forward_gives_each_node_its_paths_logits(pair):
    assert_tree_forward_is_per_path(pair[1], PROMPT, 30, TREE)


def test_a_tree_compaction_and_a_step_are_one_processes(pair):
    """The path 1 -> 4 -> 7 moves entries, on both ranks (rank 1's rides with the next
    message): the step after it reads them."""
    found = []
    for target in pair:
        cache, last = target.prefill(PROMPT)
        job = target.tree_job(cache, 30, TREE, capture=(1, 0))
        target.run([job])
        target.keep_path(cache, len(PROMPT), (1, 4, 7))
        step = target.forward_tree(cache, 50, DraftTree.chain([]))[0]
        keys = cache.layers[1].keys
        found.append((last, job.logits, job.hidden, step, keys))
    assert found[1][4].shape == (1, 2, len(PROMPT) + 5, 16)  # every rank's KV heads
    for mine, theirs in zip(*found):
        torch.testing.assert_close(theirs, mine, **ROUNDING)


def test_sessions_of_every_shape_in_one_batch_are_one_processes(pair):
    assert_batch_of_every_shape_matches(pair)


@pytest.mark.parametrize("drafter", [None, DrafterName.RECYCLE], ids=["plain", "recycle"])
def test_batched_generations_are_one_processes(pair, drafter):
    assert_batched_generations_match(*pair, drafter)


def test_split_greedy_through_the_server_is_one_processes_plain_greedy(pair):
    assert_split_server_matches(*pair, LIMITS)


@pytest.mark.parametrize("variant", ["", "last"])  # K/V gathered from the ranks; layers
def test_the_drafters_activations_are_one_processes(pair, tiny_drafter_dir, variant):
    from cloud_server.moa.activations import ServerActivations

    assert_drafter_rows_match(*pair, ServerActivations.load(tiny_drafter_dir / variant,
                                                            pair[0].model))


def test_a_full_slot_is_refused_on_every_rank_and_the_ranks_go_on(pair):
    one, split = pair
    cache = split.new_cache()
    cache.length = split.engine.local.pool.positions - 2
    with pytest.raises(Overloaded, match="reached its KV slot"):
        split.forward_tree(cache, 30, TREE)
    assert_tree_forward_is_per_path(split, PROMPT, 30, TREE)


def test_the_sizes_that_split_a_model_are_named():
    smol = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    assert fitting_sizes(smol) == (1, 3)
    assert unfit(smol, 3, None) is None
    assert unfit(smol, 2, None) == ("--tensor-parallel 2 does not divide the model's 9 attention "
                                    "heads, 3 KV heads and MLP width 1536: 1 or 3 would")
    assert unfit(smol, 3, 2) == "--tensor-parallel 3 needs 3 GPUs, 2 are present: 1 would fit"


def lone_target(model_dir, collective_s: float, lost: list[str]) -> TargetModel:
    """The tiny target over 2 ranks of its own, whose collectives wait `collective_s`."""
    one = TargetModel.load(str(model_dir), "tiny", "cpu")
    job = ShardJob(str(model_dir), torch.float32, "cpu", SlotPlan(2, 128, 8), None, False)
    engine = TensorParallelEngine.start(one.model, job, 2, torch.get_num_threads(),
                                        collective_s, lost.append)
    return TargetModel(one.model, one.tokenizer, "tiny-tp", one.device, engine)


def tree_forward(target: TargetModel) -> None:
    target.forward_tree(target.new_cache(), 30, TREE)


def test_a_rank_that_dies_mid_forward_ends_every_forward_unavailable(tiny_model_dir):
    """Rank 1 is stopped, so rank 0's forward waits in its first all-reduce, then killed:
    the forward ends well before the deadline, and so does every later one; the server is
    told once; no rank is left."""
    lost: list[str] = []
    target = lone_target(tiny_model_dir, 60.0, lost)
    rank1 = target.engine.ranks.procs[0]
    os.kill(rank1.pid, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (rank1.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(Unavailable, match="^tensor parallel: .*; the server is stopping$"):
        tree_forward(target)
    assert time.monotonic() - start < 30
    with pytest.raises(Unavailable, match="the server is stopping"):
        tree_forward(target)
    assert lost == ["tensor parallel: rank 1 of 2 was killed (SIGKILL); the server is stopping"]
    assert rank1.wait(10) == -signal.SIGKILL
    target.engine.ranks.stop()


def test_a_rank_that_hangs_fails_the_forward_at_the_deadline(tiny_model_dir):
    lost: list[str] = []
    target = lone_target(tiny_model_dir, 2.0, lost)
    rank1 = target.engine.ranks.procs[0]
    os.kill(rank1.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(Unavailable, match="a collective failed on rank 0 .*Timed out"):
        tree_forward(target)
    assert 2.0 <= time.monotonic() - start < 30
    assert len(lost) == 1 and "Timed out" in lost[0], lost
    assert rank1.wait(10) == -signal.SIGKILL  # the hung rank is not left behind
    target.engine.ranks.stop()
