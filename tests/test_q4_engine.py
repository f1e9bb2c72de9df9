"""The 4-bit engine (`--weights q4`): its blocks are the GGUF's weights, a tree forward gives each
node its path's logits, a batch gives each session what it gets alone, and split greedy output
equals the engine's own plain greedy output on the real model."""
from __future__ import annotations

import asyncio
import select
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cloud_server.engine.block_weights import BLOCK, from_gguf, quantize_q4
from cloud_server.reference import compare, plain_greedy
from cloud_server.engine.kv_cache import keep_path
from cloud_server.target import TargetModel
from shared.tree import DraftTree
from testkit.cli_harness import STARTUP_TIMEOUT_S

PROMPT = [5, 17, 42, 99, 7, 61]
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17),
                 parents=(-1, -1, 0, 0, 1, 2, 5, 4))


@pytest.fixture(scope="module")
def q4_target(tiny_model_dir):
    return TargetModel.load(str(tiny_model_dir), "tiny-llama", "cpu", weights="q4")


def last_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    return target.prefill(ids)[1]


def test_quantized_blocks_stand_for_the_weight_within_half_a_step():
    weight = np.random.default_rng(0).standard_normal((8, 4 * BLOCK)).astype(np.float32)
    blocks = quantize_q4(weight)
    step = blocks.scales.repeat(BLOCK, axis=1)  # [8, in]
    assert blocks.codes.max() <= 15 and blocks.shape == weight.shape
    assert np.all(np.abs(blocks.dense() - weight) <= 0.5 * step + 1e-3)


def test_a_decoding_step_computes_what_a_longer_forward_does(q4_target):
    """The lone-token forward (run beside its twin) equals the token's row of a prefill."""
    ids = PROMPT + [30, 10]
    cache, _ = q4_target.prefill(ids[:-1])
    step = q4_target.forward_tree(cache, ids[-1], DraftTree.chain([]))[0]
    assert torch.equal(step, last_logits(q4_target, ids))


def test_tree_forward_matches_each_path(q4_target):
    cache, _ = q4_target.prefill(PROMPT)
    logits = q4_target.forward_tree(cache, 30, TREE)  # [1 + n, vocab]
    base = PROMPT + [30]
    torch.testing.assert_close(logits[0], last_logits(q4_target, base), atol=1e-5, rtol=0)
    for node in range(len(TREE)):
        expected = last_logits(q4_target, base + TREE.path_tokens(node))
        torch.testing.assert_close(logits[node + 1], expected, atol=1e-5, rtol=0)


def test_compacted_cache_continues_like_plain_decoding(q4_target):
    cache, _ = q4_target.prefill(PROMPT)
    q4_target.forward_tree(cache, 30, TREE)
    accepted = (1, 4, 7)
    keep_path(cache, len(PROMPT), accepted)
    nxt = q4_target.forward_tree(cache, 3, DraftTree.chain([8]))
    committed = PROMPT + [30] + [TREE.tokens[i] for i in accepted] + [3, 8]
    torch.testing.assert_close(nxt[1], last_logits(q4_target, committed), atol=1e-5, rtol=0)


def test_a_batch_gives_each_session_what_it_gets_alone(q4_target):
    prompts = [PROMPT, [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    trees = [TREE, DraftTree.chain([4, 5]), DraftTree.chain([])]
    alone = []
    for prompt, tree in zip(prompts, trees):
        cache, _ = q4_target.prefill(prompt)
        alone.append(q4_target.forward_tree(cache, 30, tree))
    caches = [q4_target.prefill(prompt)[0] for prompt in prompts]
    jobs = [q4_target.tree_job(cache, 30, tree, capture=(0, 1))
            for cache, tree in zip(caches, trees)]
    q4_target.run(jobs)
    for job, expected, tree in zip(jobs, alone, trees):
        torch.testing.assert_close(job.logits, expected, atol=1e-5, rtol=0)
        assert job.hidden is not None and job.hidden.shape == (1 + len(tree), 2, 64)


def test_plain_greedy_runs_through_the_engine(q4_target):
    out = plain_greedy(q4_target, PROMPT, 12)
    cache, logits = q4_target.prefill(PROMPT)
    for token in out:
        assert token == int(logits.argmax())
        logits = q4_target.forward_tree(cache, token, DraftTree.chain([]))[0]


@pytest.mark.slow
def test_a_model_the_engine_cannot_run_is_refused_by_name(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    from testkit.tiny_model import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--weights q4 cannot run it: .*biases.*--weights fp32 will"):
        TargetModel.load(str(tmp_path), "biased", "cpu", weights="q4")
    from cloud_server.engine.transformers_engine import ModulesEngine

    engine = TargetModel.load(str(tmp_path), "biased", "cpu", weights="auto").engine
    assert isinstance(engine, ModulesEngine)
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", "--model", str(tmp_path),
                           "--weights", "q4", "--drafter-dir", "none", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cloud-server: error: ") and "--weights q4 cannot run it" in last
    assert last.endswith("--weights fp32 will")


@pytest.mark.slow
def test_gguf_blocks_are_the_checkpoints_weights(tmp_path, monkeypatch):
    """Read from the GGUF as shipped (q/k rows back in the checkpoint's order), the blocks equal
    the fp32 checkpoint transformers dequantized from the same file; read again, from the
    layers kept under the cache directory, they are the same."""
    from safetensors.torch import load_file

    from cloud_server import model_store

    checkpoint = model_store.default_checkpoint()
    state = {k: v for f in checkpoint.glob("*.safetensors") for k, v in load_file(f).items()}
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    blocks = from_gguf(model_store.gguf_path(), 9, 3)
    assert len(list((tmp_path / "models").glob("*.layers.npz"))) == 1
    again = from_gguf(model_store.gguf_path(), 9, 3)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj",
                 "model.layers.29.mlp.down_proj"):
        assert np.array_equal(blocks[name].dense(), state[name + ".weight"].numpy()), name
        assert np.array_equal(again[name].codes, blocks[name].codes), name
    assert blocks["lm_head"].bits == 8
    assert np.array_equal(blocks["lm_head"].dense(), state["model.embed_tokens.weight"].numpy())


def test_real_model_split_equals_plain_through_the_engine(real_q4_target, real_q4_server):
    from edge_client.client import ClientOptions, EdgeClient
    from shared import prompt_sets as prompts
    from shared.messages import ChatMessage, OpenRequest

    texts = [row["prompt"] for name in prompts.SETS for row in prompts.load(name, limit=1)]
    max_new = 40

    async def go():
        async with EdgeClient(server.address, ClientOptions("pld", 16, max_new)) as client:
            return [await client.generate(OpenRequest(chat=(ChatMessage("user", t),),
                                                      max_new_tokens=max_new)) for t in texts]

    server = real_q4_server
    results = asyncio.run(go())
    for text, result in zip(texts, results):
        plain = plain_greedy(real_q4_target, result.prompt_ids, max_new)
        assert result.output_ids == plain, (text[:60], compare(
            real_q4_target, result.prompt_ids, result.output_ids, plain))
    assert sum(r.rounds for r in results) < sum(len(r.output_ids) for r in results)


def test_auto_keeps_a_users_checkpoint_in_its_precision(tiny_model_dir):
    """Only a model converted from a 4-bit GGUF runs 4-bit unasked (issue 54: a user's Llama was
    rounded silently); a user's checkpoint is served as it is, its weights the modules' own."""
    from cloud_server.engine.transformers_engine import ModulesEngine

    target = TargetModel.load(str(tiny_model_dir), "tiny-llama", "cpu", weights="auto")
    assert isinstance(target.engine, ModulesEngine)
    assert target.model.dtype == torch.float32


@pytest.mark.parametrize("at_start", [True, False], ids=["start", "first-use"])
def test_graphs_built_at_start_leave_no_batch_waiting_for_a_build(tiny_model_dir, monkeypatch,
                                                                  at_start):
    """`--batch-graphs start`: before the server serves, the engine holds a graph for every
    batch it may run (3 sessions run on the 4-session graph), so no build stalls a batch;
    `first-use` builds it in the batch's forward."""
    from cloud_server.config import ServerConfig
    from cloud_server.engine import onnx_engine
    from cloud_server.model_thread import ModelThread
    from cloud_server.rpc.server import build_service
    from shared.messages import Limits

    target = TargetModel.load(str(tiny_model_dir), "tiny-llama", "cpu", weights="q4")
    model_thread = ModelThread()
    try:
        build_service(target, ServerConfig(Limits(max_sessions=3), graphs_at_start=at_start),
                      model_thread)
    finally:
        model_thread.shutdown()
    caches = [target.prefill(prompt)[0] for prompt in (PROMPT, [9, 8, 7], [1, 2, 3])]

    def no_build(*args, **kwargs):
        raise AssertionError("a batch waited for a graph build")
    monkeypatch.setattr(onnx_engine.ort, "InferenceSession", no_build)
    jobs = [target.tree_job(cache, 30, TREE) for cache in caches]
    if at_start:
        target.run(jobs)
        assert all(len(job.logits) == 1 + len(TREE) for job in jobs)
    else:
        with pytest.raises(AssertionError, match="waited for a graph build"):
            target.run(jobs)


def test_the_cli_builds_the_batch_graphs_before_it_listens(tiny_model_dir, tmp_path):
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--model",
                                 str(tiny_model_dir), "--weights", "q4", "--batch-graphs",
                                 "start", "--max-sessions", "2", "--drafter-dir", "none",
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT_S)
            assert ready and proc.stdout.readline().startswith("listening on ")
            assert "building the 4-bit graph for 2 sessions" in log.read_text()
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
