"""The static engine (cloud_server/engine/static_engine.py) on the CPU, with its forwards padded
to the buckets and replayed under the CUDA-graph contract (`Rehearsal`: fixed input tensors,
outputs overwritten by the next replay): a tree forward gives each node its path's logits, a
batch of sessions with pads gives each what it gets alone, compaction keeps the accepted path,
the slots are refused when full, and split decoding through the server is plain greedy
decoding. The same tests run eagerly and unpadded, as the CPU serves it."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_server.config import ServerConfig
from cloud_server.device import EngineChoice, Graphs, Weights
from cloud_server.engine.buckets import Buckets
from cloud_server.engine.choice import pick_engine
from cloud_server.engine.cuda_graphs import Rehearsal, Replay, failed_captures
from cloud_server.engine.static_engine import SlotPlan, StaticEngine
from cloud_server.engine.transformers_engine import ModulesEngine
from cloud_server.model_thread import ModelThread
from cloud_server.rpc.server import build_service
from cloud_server.target import TargetModel
from shared.errors import Overloaded
from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import Limits, OpenRequest
from shared.tree import DraftTree
from testkit.device_under_test import DEVICE
from testkit.split_checks import assert_split_greedy_is_plain
from testkit.tree_checks import assert_tree_forward_is_per_path, causal_logits
from tests.server_harness import ServerThread

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 7, 61, 3, 9, 11, 12, 13]
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17), parents=(-1, -1, 0, 0, 1, 2, 5, 4))
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=300, max_new_tokens=64,
                max_sessions=6, session_idle_timeout_s=5)
PLAN = SlotPlan(LIMITS.max_sessions, 400, LIMITS.max_tree_nodes)


def static_target(tiny_target: TargetModel, graphs: bool) -> TargetModel:
    """`graphs`: CUDA graphs on a GPU (SPLITDEC_TEST_DEVICE=cuda), their rehearsal here."""
    kind = Replay if tiny_target.device.type == "cuda" else Rehearsal
    engine = StaticEngine(tiny_target.model, tiny_target.device, PLAN,
                          kind if graphs else None, pad=graphs)
    return TargetModel(tiny_target.model, tiny_target.tokenizer, "tiny-static",
                       tiny_target.device, engine)


@pytest.fixture(scope="module", params=["rehearsed", "eager"])
def target(request: pytest.FixtureRequest, tiny_target: TargetModel) -> TargetModel:
    return static_target(tiny_target, request.param == "rehearsed")


def test_a_tree_forward_gives_each_node_its_paths_logits(target):
    assert_tree_forward_is_per_path(target, PROMPT, 30, TREE)


def test_every_bucket_captures_as_the_server_prepares_it(tiny_target):
    """build_service calls prepare outside inference mode, so capture ran the forward with
    autograd on: the first bucket failed (the KV slots written in place) and decoding steps
    ran eagerly (found rehearsing on the CPU)."""
    engine = static_target(tiny_target, graphs=True).engine
    failed = failed_captures()
    engine.prepare([(), (0, 1)], PLAN.sessions)
    assert failed_captures() == failed


FAILING_CAPTURE = """
import torch
from cloud_server.engine.cuda_graphs import Rehearsal, capture_or_none


def refused(ints, tree):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_shape_fails_to_capture():
    zeros = torch.zeros(1)
    assert capture_or_none(Rehearsal, refused, zeros, zeros, None, "Shape(1, 3, 256)") is None


def test_nothing_is_captured():
    pass
"""


def test_a_shape_that_fails_to_capture_fails_its_test(tmp_path):
    """It runs eagerly, right, and its stderr line went with a passing test's output: a GPU
    run counted fewer failed captures than there were (tests/conftest.py)."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport\n")
    (tmp_path / "test_capture.py").write_text(FAILING_CAPTURE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed" in proc.stdout
    assert "1 forward shape(s) failed to capture:\nShape(1, 3, 256): operation not" in proc.stdout


def counting_rehearsal() -> tuple[type[Rehearsal], list[tuple[int, int]]]:
    """A Rehearsal that notes each capture's [sessions, tokens], and the notes."""
    made: list[tuple[int, int]] = []

    class Counted(Rehearsal):
        def __init__(self, step, ints, tree, pool):
            made.append((tree.shape[0], tree.shape[1]))
            super().__init__(step, ints, tree, pool)
    return Counted, made


@pytest.mark.parametrize("at_start", [True, False], ids=["start", "first-use"])
def test_the_server_captures_the_session_buckets_its_batches_may_use(tiny_target, at_start,
                                                                    capsys):
    """build_service prepares the buckets of one session a forward, or with `--batch-graphs
    start` of up to --max-sessions (6: buckets 1, 2, 4, 6; every bucket once captured 160
    shapes a capture set on a GPU at the defaults); a batch of 3 then runs on the 4-session
    bucket captured at startup, or captures it when it first comes, and says so."""
    kind, made = counting_rehearsal()
    engine = StaticEngine(tiny_target.model, tiny_target.device, PLAN, kind)
    target = TargetModel(tiny_target.model, tiny_target.tokenizer, "tiny-static",
                         tiny_target.device, engine)
    model_thread = ModelThread()
    try:
        build_service(target, ServerConfig(LIMITS, graphs_at_start=at_start), model_thread)
    finally:
        model_thread.shutdown()
    per_session_bucket = len(engine.buckets.tokens) * len(engine.buckets.contexts)
    sessions = (1, 2, 4, 6) if at_start else (1,)
    assert sorted(set(made)) == [(s, t) for s in sessions for t in engine.buckets.tokens]
    assert len(made) == len(sessions) * per_session_bucket
    line = (f"capturing {len(made)} forward shapes (sessions {'/'.join(map(str, sessions))} x "
            "tokens 1/3/5/9/17 x positions 256/400 x layer outputs none; ")
    assert line in capsys.readouterr().err
    captured = len(made)
    caches = [target.prefill(prompt)[0] for prompt in (PROMPT, [9, 8, 7], [1, 2, 3])]
    target.run([target.tree_job(cache, 30, TREE) for cache in caches])
    assert made[captured:] == ([] if at_start else [(4, 9)])


def test_a_prompt_longer_than_every_bucket_runs_eagerly_and_exactly(target):
    prompt = [(7 * i) % 300 + 3 for i in range(290)]  # a 256-token chunk, then 34
    _, last = target.prefill(prompt)
    torch.testing.assert_close(last, causal_logits(target, prompt)[-1], atol=1e-4, rtol=0)


def test_sessions_of_every_shape_in_one_batch_get_what_they_get_alone(target):
    """Pads in every direction: rows of 1, 9 and 3 tokens, 4 sessions in a bucket of 4 or
    5 (a pad row), contexts from 2 to 41; the captured layers come out per session."""
    prompts = [PROMPT, PROMPT[:2], list(range(40, 80)), [100]]
    trees = [TREE, DraftTree.chain([]), DraftTree.chain([4, 5]), TREE]
    alone = []
    for prompt, tree in zip(prompts, trees):
        cache, _ = target.prefill(prompt)
        job = target.tree_job(cache, 30, tree, capture=(0, 1))
        target.run([job])
        alone.append((job.logits, job.hidden))
        del cache, job
    caches = [target.prefill(prompt)[0] for prompt in prompts]
    jobs = [target.tree_job(c, 30, t, capture=(0, 1)) for c, t in zip(caches, trees)]
    target.run(jobs)
    for (logits, hidden), job in zip(alone, jobs):
        torch.testing.assert_close(job.logits, logits, atol=1e-5, rtol=0)
        assert job.hidden is not None and hidden is not None
        torch.testing.assert_close(job.hidden, hidden, atol=1e-5, rtol=0)


def test_captured_layers_are_the_modules_layer_outputs(target, tiny_target):
    reference = tiny_target.prefill(PROMPT)[0]
    cache = target.prefill(PROMPT)[0]
    jobs = [t.tree_job(c, 30, TREE, capture=(1, 0)) for t, c in
            ((tiny_target, reference), (target, cache))]
    tiny_target.run(jobs[:1])
    target.run(jobs[1:])
    assert jobs[1].hidden is not None and jobs[1].hidden.shape == (1 + len(TREE), 2, 64)
    torch.testing.assert_close(jobs[1].hidden, jobs[0].hidden, atol=1e-4, rtol=0)


def test_compaction_keeps_the_accepted_path(target):
    """After a tree and keep_path of the path 1 -> 4 -> 7, a step sees exactly the text
    prompt + pending + those nodes, as a fresh prefill of it does."""
    cache, _ = target.prefill(PROMPT)
    target.forward_tree(cache, 30, TREE)
    target.keep_path(cache, len(PROMPT), (1, 4, 7))
    assert cache.get_seq_length() == len(PROMPT) + 4
    committed = PROMPT + [30, *TREE.path_tokens(7)]
    step = target.forward_tree(cache, 50, DraftTree.chain([]))[0]
    torch.testing.assert_close(step, causal_logits(target, committed + [50])[-1],
                               atol=1e-4, rtol=0)
    keys = cache.layers[0].keys
    assert keys.shape[:3] == (1, 2, len(committed) + 1)


def test_slots_are_refused_when_full_and_come_back_when_a_cache_is_dropped(target):
    held = [target.new_cache(100) for _ in range(PLAN.sessions)]
    with pytest.raises(Overloaded, match="KV slots are taken"):
        target.new_cache(100)
    held.pop()
    cycle: list = [target.new_cache(100)]  # a finished session's cache in a reference cycle
    cycle.append(cycle)
    del cycle
    target.new_cache(100)
    with pytest.raises(Overloaded, match="does not fit a KV slot"):
        held.clear()
        target.new_cache(PLAN.positions + 1)


def test_buckets_hold_a_pending_token_and_trees_up_to_the_largest():
    buckets = Buckets.up_to(most_tree_nodes=64, positions=6000, most_sessions=16)
    assert buckets.tokens == (1, 3, 5, 9, 17, 33, 65)
    assert buckets.contexts == (256, 1024, 4096, 6000)
    assert buckets.sessions == (1, 2, 4, 8, 16)
    assert buckets.fit(3, 9, 300).__dict__ == dict(sessions=4, tokens=9, context=1024)
    assert buckets.fit(1, 66, 10) is None


@pytest.mark.parametrize("drafter", ["pld", "aded"])
def test_split_greedy_through_the_server_is_plain_greedy(target, drafter):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(20, 32)) * 2, [100]]
    with ServerThread(target, ServerConfig(LIMITS)) as server:
        assert_split_greedy_is_plain(target, server.address, drafter, 8, prompts, 40)


def test_a_bf16_target_through_rehearsed_graphs_is_its_plain_greedy(tiny_model_dir):
    """The GPU node's default (`--dtype auto`: bf16, graphs captured at startup), rehearsed
    on the CPU."""
    bf16 = TargetModel.load(str(tiny_model_dir), "tiny-llama", DEVICE, precision="bf16")
    target = static_target(bf16, graphs=True)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(20, 32)) * 2]
    with ServerThread(target, ServerConfig(LIMITS)) as server:
        assert_split_greedy_is_plain(target, server.address, "pld", 8, prompts, 40)


def test_an_engine_that_cannot_run_the_model_names_the_one_that_will(tmp_path):
    from testkit.target_families import build_family

    path = build_family("gemma2", tmp_path)
    with pytest.raises(ValueError, match="--engine static cannot run it: .*--engine "
                                         "transformers will"):
        TargetModel.load(str(path), "gemma2", "cpu", engine="static")
    with pytest.raises(ValueError, match="--cuda-graphs on needs the target on CUDA"):
        TargetModel.load(str(path), "gemma2", "cpu", graphs="on")
    assert isinstance(TargetModel.load(str(path), "gemma2", "cpu").engine, ModulesEngine)
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", "--model", str(path),
                           "--engine", "static", "--drafter-dir", "none", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cloud-server: error: ") and last.endswith("transformers will")


def test_rehearsed_graphs_pick_the_engine_cuda_picks(tiny_target, tmp_path):
    """`--cuda-graphs rehearse` (SPLITDEC_TEST_DEVICE=cpu-graphs): on the CPU, the static
    engine padded to the buckets where CUDA picks it, even for a model from a 4-bit GGUF
    (whose file it then never reads), and the modules where CUDA picks them; never the 4-bit
    engine, which has no such graphs."""
    from testkit.target_families import build_family

    engine = pick_engine(tiny_target.model, torch.device("cpu"), Weights.AUTO,
                         EngineChoice.AUTO, Graphs.REHEARSE, PLAN, tmp_path / "absent.gguf",
                         True)
    assert isinstance(engine, StaticEngine)
    assert engine.describe().startswith("static engine, rehearsed graphs, float32")
    path = build_family("gemma2", tmp_path)
    assert isinstance(TargetModel.load(str(path), "gemma2", "cpu", graphs="rehearse").engine,
                      ModulesEngine)
    with pytest.raises(ValueError, match="--cuda-graphs rehearse is the static engine's"):
        pick_engine(tiny_target.model, torch.device("cpu"), Weights.Q4, EngineChoice.AUTO,
                    Graphs.REHEARSE, PLAN, None, True)


@pytest.mark.parametrize("variant", ["", "last"])  # K/V read from the cache; layers captured
def test_the_drafters_activations_are_the_modules(target, tiny_target, tiny_drafter_dir,
                                                   variant):
    from cloud_server.moa.activations import ServerActivations

    activations = ServerActivations.load(tiny_drafter_dir / variant, tiny_target.model)
    layers = activations.hidden_layers
    found = []
    for t in (tiny_target, target):
        cache = t.new_cache()
        _, hidden = t.drive(t.prefill_jobs(cache, PROMPT, layers))
        found.append(activations(cache, 0, len(PROMPT), hidden, dtype=np.float32))
    np.testing.assert_allclose(found[1], found[0], atol=1e-4)


@pytest.mark.parametrize("variant", ["", "last"])
def test_moa_split_greedy_through_the_server_is_plain_greedy(target, tiny_drafter_dir, variant,
                                                              tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    config = ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir / variant)
    prompts = [[1, 46, 47, 48, 49], [1, 60, 61, 62]]
    with ServerThread(target, config) as server:
        results = split_outputs(server.address, "moa", prompts, 32)
    for prompt, result in zip(prompts, results):  # lossless; how much is accepted is the drafter's
        assert compare(target, prompt, result.output_ids, plain_greedy(target, prompt, 32)).lossless


def split_outputs(address: str, drafter: str, prompts: list[list[int]], max_new: int) -> list:
    async def go() -> list:
        async with EdgeClient(address, ClientOptions(drafter, 16, max_new)) as client:
            return [await client.generate(OpenRequest(prompt_ids=tuple(p),
                                                      max_new_tokens=max_new))
                    for p in prompts]
    return asyncio.run(go())
