"""`--tensor-parallel 3` on the real SmolLM2-135M (9 heads, 3 KV heads: three heads and one KV
head a rank), gloo, fp32: split decoding with the committed MoA drafter is one process's plain
greedy decoding, and what the drafter's server half reads (the last layer's outputs) and the
logits equal one process's within fp32 rounding; split by transformers' own plan too."""
from __future__ import annotations

import pytest
import torch

from cloud_server.target import TargetModel
from shared.messages import ChatMessage, Limits
from tests.in_process import split_greedy

pytestmark = pytest.mark.slow

PROMPT = "Explain in three sentences why the sky is blue."
SLOTS = Limits(max_tree_nodes=32, max_prompt_tokens=256, max_new_tokens=64, max_sessions=2)


@pytest.fixture(scope="module")
def targets():
    """(one process's static engine, the same over 3 ranks), fp32, eager."""
    from cloud_server import model_store

    path, model_id = model_store.resolve("default")
    threads = torch.get_num_threads()
    load = dict(precision="fp32", weights="fp32", engine="static", limits=SLOTS)
    split = TargetModel.load(path, model_id, "cpu", ranks=3, **load)
    one = TargetModel.load(path, model_id, "cpu", **load)
    yield one, split
    split.engine.ranks.stop()
    torch.set_num_threads(threads)


def prompt_ids(target: TargetModel) -> list[int]:
    return target.apply_chat_template((ChatMessage("user", PROMPT),))


def test_the_layer_the_drafter_reads_and_the_logits_are_one_processes(targets):
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.moa.weights import committed_drafter

    one, split = targets
    drafter_dir = committed_drafter(one.model_id)
    assert drafter_dir is not None
    layers = ServerActivations.load(drafter_dir, one.model).hidden_layers
    found = []
    for target in targets:
        last, hidden = target.drive(target.prefill_jobs(target.new_cache(), prompt_ids(one),
                                                        layers))
        found.append((last.logits[-1], hidden))
    (logits, hidden), (split_logits, split_hidden) = found
    scale = float(hidden.abs().max())
    torch.testing.assert_close(split_hidden, hidden, atol=1e-5 * scale, rtol=0)
    torch.testing.assert_close(split_logits, logits, atol=1e-5 * float(logits.abs().max()),
                               rtol=0)


def test_moa_split_greedy_over_3_ranks_is_one_processes_plain_greedy(targets, tmp_path):
    assert_moa_split_is_plain(*targets, tmp_path)


def test_split_by_transformers_plan_over_3_ranks_is_one_processes_plain_greedy(targets,
                                                                               tmp_path):
    """The transformers engine split by transformers' own plan (modules_parallel.py), on
    the real model: MoA split decoding is plain greedy decoding."""
    from cloud_server import model_store

    path, model_id = model_store.resolve("default")
    split = TargetModel.load(path, model_id, "cpu", ranks=3, precision="fp32", weights="fp32",
                             engine="transformers", limits=SLOTS)
    try:
        assert_moa_split_is_plain(targets[0], split, tmp_path)
    finally:
        split.engine.ranks.stop()


def assert_moa_split_is_plain(one: TargetModel, split: TargetModel, tmp_path) -> None:
    """Split greedy decoding on `split` with the committed MoA drafter is `one`'s plain
    greedy decoding, and its drafts are accepted."""
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.moa.weights import committed_drafter
    from cloud_server.reference import compare, plain_greedy
    from edge_client.drafters.trained import trained_drafter
    from edge_client.drafters.tree_search import TreeSearch
    from shared.drafter_bundle import Precision
    from shared.drafting.base import DrafterName

    drafter_dir = committed_drafter(split.model_id)
    assert drafter_dir is not None
    bundle = build_bundle(drafter_dir, split.model, split.model_id, tmp_path)
    server = ServerActivations.load(drafter_dir, split.model)
    drafter = trained_drafter(bundle, DrafterName.MOA, TreeSearch(), precision=Precision.INT8)
    prompt = prompt_ids(split)
    tokens, per_round = split_greedy(split, server, drafter, prompt, 48, max_nodes=32)
    plain = plain_greedy(one, prompt, 48)
    assert compare(one, prompt, tokens[:48], plain).lossless
    # the committed drafter's tau on one process is 1.68 here (tests/test_moa_real.py)
    assert sum(per_round) / len(per_round) > 1.25, per_round
