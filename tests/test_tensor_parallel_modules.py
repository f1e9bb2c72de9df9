"""`--tensor-parallel --engine transformers`: the transformers engine split over 2 ranks by
transformers' own plan (gloo, fp32; rank 1 a child process) gives what one process's
transformers engine gives: tree forwards, compaction, batched sessions, the layer outputs a
drafter reads, plain decoding, server-side speculation and split decoding through the server.
What it cannot serve is refused with one line (test_tensor_parallel_modules_lone.py: another
family, a rank that dies)."""
from __future__ import annotations

import pytest
import torch

from cloud_server.engine.modules_parallel import ModulesParallelEngine
from cloud_server.target import TargetModel
from shared.drafting.base import DrafterName
from testkit.tree_checks import assert_tree_forward_is_per_path
from tests.parallel_checks import (
    LIMITS, PROMPT, TREE, assert_batch_of_every_shape_matches,
    assert_batched_generations_match, assert_drafter_rows_match, assert_split_server_matches,
)

pytestmark = pytest.mark.slow  # each engine starts a rank: seconds, more on a busy machine


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(one process's transformers engine, the same over 2 ranks by the model's plan)."""
    threads = torch.get_num_threads()
    load = dict(engine="transformers", limits=LIMITS)
    split = TargetModel.load(str(tiny_model_dir), "tiny-tp", "cpu", ranks=2, **load)
    one = TargetModel.load(str(tiny_model_dir), "tiny-one", "cpu", **load)
    assert isinstance(split.engine, ModulesParallelEngine)
    yield one, split
    split.engine.ranks.stop()
    torch.set_num_threads(threads)


def test_a_tree_forward_gives_each_node_its_paths_logits(pair):
    assert_tree_forward_is_per_path(pair[1], PROMPT, 30, TREE)


def test_a_compaction_then_batched_sessions_are_one_processes(pair):
    """The compaction moves entries on both ranks (rank 1's rides with the next message)."""
    assert_batch_of_every_shape_matches(pair, compact_first=True)


@pytest.mark.parametrize("drafter", [None, DrafterName.RECYCLE], ids=["plain", "recycle"])
def test_batched_generations_are_one_processes(pair, drafter):
    assert_batched_generations_match(*pair, drafter)


def test_split_greedy_through_the_server_is_one_processes_plain_greedy(pair):
    assert_split_server_matches(*pair, LIMITS)


def test_the_layer_a_drafter_reads_is_one_processes_and_cache_kv_is_refused(
        pair, tiny_drafter_dir):
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.rpc.drafter_serving import serve_drafter

    one, split = pair
    assert_drafter_rows_match(one, split, ServerActivations.load(tiny_drafter_dir / "last",
                                                                 one.model))
    with pytest.raises(ValueError, match="reads the cache's K/V.*split over the ranks"):
        serve_drafter(tiny_drafter_dir, split)  # its default variant reads the cache's K/V


def test_what_the_plan_cannot_run_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from testkit.target_families import build_family

    mistral = build_family("mistral", tmp_path / "mistral")
    with pytest.raises(ValueError, match="--engine static cannot run it: .*--engine "
                                         "transformers will"):
        TargetModel.load(str(mistral), "mistral", "cpu", ranks=2, engine="static")
    bloom = build_family("bloom", tmp_path / "bloom")
    with pytest.raises(ValueError, match="transformers has no tensor-parallel plan for bloom"):
        TargetModel.load(str(bloom), "bloom", "cpu", ranks=2)
    with pytest.raises(ValueError, match="runs unquantized weights, not --weights q4"):
        TargetModel.load(str(tiny_model_dir), "tiny", "cpu", ranks=2, weights="q4")
    with pytest.raises(ValueError, match="--cuda-graphs rehearse is the static engine's"):
        TargetModel.load(str(tiny_model_dir), "tiny", "cpu", ranks=2, engine="transformers",
                         graphs="rehearse")
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        TargetModel.load(str(tiny_model_dir), "tiny", "cpu", ranks=3, engine="transformers")


def test_a_second_split_target_in_one_process_is_refused(pair, tiny_model_dir):
    with pytest.raises(ValueError, match="already holds a tensor-parallel target"):
        TargetModel.load(str(tiny_model_dir), "tiny", "cpu", ranks=2, engine="transformers")

