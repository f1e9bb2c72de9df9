"""The families operators serve, each as a tiny random checkpoint (testkit/target_families.py),
through the equivalences SmolLM2 passes: a tree forward gives each node its own path's logits,
a batched forward gives each session what it gets alone, plain greedy decoding is transformers'
`generate`, and split greedy decoding is plain greedy decoding, with prompts that run past the
sliding window."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cloud_server.engine.transformers_engine import ModulesEngine
from cloud_server.reference import plain_greedy
from cloud_server.self_check import UnverifiedModel
from cloud_server.target import TargetModel
from shared.messages import Limits
from shared.tree import DraftTree
from testkit.device_under_test import load_target
from testkit.split_checks import assert_split_greedy_is_plain
from testkit.tree_checks import assert_tree_forward_is_per_path
from testkit.target_families import FAMILIES, WINDOW, build_family
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

PROMPT = [5, 17, 42, 99, 7, 61, 3, 9, 11, 12, 13, 14, 15]  # past the window
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17), parents=(-1, -1, 0, 0, 1, 2, 5, 4))
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(20, 32)) * 2, [100]]
MAX_NEW = 24
assert len(PROMPT) > WINDOW


# The families the static engine runs (engine/static_llama.py), through it as well.
STATIC = ("llama3", "qwen2", "qwen3")
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=64, max_new_tokens=64,
                max_sessions=8, session_idle_timeout_s=5)


@pytest.fixture(scope="module", params=[*((f, "transformers") for f in sorted(FAMILIES)),
                                        *((f, "static") for f in STATIC)],
                ids=lambda p: "-".join(p))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> TargetModel:
    family, engine = request.param
    path = build_family(family, tmp_path_factory.mktemp(family))
    return load_target(str(path), family, engine=engine, limits=LIMITS)


def test_a_tree_forward_gives_each_node_its_paths_logits(target):
    assert_tree_forward_is_per_path(target, PROMPT, 30, TREE)


def test_a_batched_forward_gives_each_session_what_it_gets_alone(target):
    assert target.batchable
    prompts = [PROMPT, PROMPT[:5], list(range(40, 60))]
    alone = []
    for prompt in prompts:
        cache, _ = target.prefill(prompt)
        alone.append(target.forward_tree(cache, 30, TREE))
    jobs = []
    for prompt in prompts:
        cache, _ = target.prefill(prompt)
        jobs.append(target.tree_job(cache, 30, TREE))
    target.run(jobs)
    together = [job.logits for job in jobs]
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def modules_target(target: TargetModel) -> TargetModel:
    """The same modules through transformers, whatever engine `target` runs."""
    return TargetModel(target.model, target.tokenizer, target.model_id, target.device,
                       ModulesEngine(target.model, target.device))


def test_decoding_steps_past_the_window_are_transformers_generate(target):
    """Step by step through the server's forwards (a whole cache, the window in the mask)
    against transformers' own greedy generation (its sliding-window cache)."""
    cache, last = target.prefill(PROMPT)
    ids = [int(last.argmax())]
    for _ in range(MAX_NEW - 1):
        ids.append(int(target.forward_tree(cache, ids[-1], DraftTree.chain([]))[0].argmax()))
    expected = plain_greedy(modules_target(target), PROMPT, MAX_NEW)
    assert ids[: len(expected)] == expected


@pytest.mark.parametrize("drafter", ["pld", "aded"])
def test_split_greedy_is_plain_greedy(target, drafter):
    with ServerThread(target, ServerConfig(LIMITS)) as server:
        assert_split_greedy_is_plain(target, server.address, drafter, 8, PROMPTS, MAX_NEW)


def test_an_architecture_outside_the_table_loads_when_it_passes_the_self_check(tmp_path):
    target = load_target(str(build_family("olmo2", tmp_path)), "olmo2")
    cache, _ = target.prefill(PROMPT)
    assert target.forward_tree(cache, 30, TREE).shape == (1 + len(TREE), target.vocab_size)


def test_an_architecture_that_fails_the_self_check_is_refused_with_one_line(tmp_path):
    path = build_family("bloom", tmp_path)
    with pytest.raises(UnverifiedModel, match=r"\(bloom\) is outside the verified families"):
        load_target(str(path), "bloom")
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", "--model", str(path),
                           "--drafter-dir", "none", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cloud-server: error: ") and "failed the startup self-check" in last
