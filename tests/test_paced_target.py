"""The GPU-paced stand-in (benchmarks/paced_target.py): a forward gives every row its rule's
ranking, batched or not; through the real server every method's answer is the rule's own
continuation, split's and plain's alike, several sessions sharing forwards; and
`host_overhead --paced-ms` runs end to end."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cloud_server.config import ServerConfig
from cloud_server.target import TargetModel
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafter_source import DrafterPool
from edge_client.server_only import Mode, server_generate
from shared.messages import Limits, OpenRequest, Pace
from shared.tree import DraftTree
from testkit.paced_target import TOP_K, PacedEngine, RuleOracle, SuccessorRule
from testkit.profile_oracle import load_profile
from testkit.tiny_prompts import PROMPTS
from tests.server_harness import ServerThread

ROOT = Path(__file__).resolve().parents[1]

# Long enough that sessions opened together queue behind one forward and share the next
HOLD_S = 0.005
MAX_NEW = 24
METHODS = ("plain-api", "server-spec", "split-lockstep", "split-auto")
PACES = {"split-lockstep": Pace.LOCKSTEP, "split-auto": Pace.AUTO}


@pytest.fixture(scope="module")
def paced(tiny_target) -> TargetModel:
    rule = SuccessorRule.of(tiny_target.tokenizer, tiny_target.vocab_size)
    engine = PacedEngine(rule, HOLD_S, tiny_target.kv_bytes_per_token, rows=4)
    return TargetModel(tiny_target.model, tiny_target.tokenizer, "tiny-paced",
                       tiny_target.device, engine)


def _greedy(rule: SuccessorRule, token: int, position: int) -> int:
    return int(rule.top(np.array([token]), np.array([position]))[0, 0])


def test_a_batched_forward_gives_each_row_the_rules_ranking(paced):
    rule = paced.engine.rule
    a, b = paced.new_cache(), paced.new_cache()
    prefill = [next(paced.prefill_jobs(a, [5, 6, 7])), next(paced.prefill_jobs(b, [9] * 5))]
    paced.run(prefill)
    assert [job.logits.argmax(-1).tolist() for job in prefill] == [[_greedy(rule, 7, 2)],
                                                                    [_greedy(rule, 9, 4)]]
    tree = DraftTree((11, 12, 13, 14, 15, 16), (-1, 0, 1, -1, 3, 3))
    trees = [paced.tree_job(a, 8, tree), paced.tree_job(b, 10, tree)]
    paced.run(trees)  # 14 rows: past the buffer's 4, which grows
    for job in trees:
        ranked = job.logits.topk(TOP_K, dim=-1)
        assert ranked.indices.tolist() == rule.top(np.array(job.ids), job.positions).tolist()
        assert job.logits.gt(0).sum() == TOP_K * len(job.ids)  # the rest of each row is 0
    assert (a.get_seq_length(), b.get_seq_length()) == (3 + 7, 5 + 7)
    paced.keep_path(a, 3, (0, 1))
    assert a.get_seq_length() == 3 + 1 + 2
    step = paced.tree_job(a, 17, DraftTree((), ()))
    paced.run([step])  # the tree forward's entries in row 0 are gone
    assert step.logits.gt(0).sum() == TOP_K and step.logits.argmax() == _greedy(rule, 17, 6)


def _client(address: str, rule: SuccessorRule) -> EdgeClient:
    oracles = DrafterPool(lambda: RuleOracle(rule, load_profile(), MAX_NEW))
    return EdgeClient(address, ClientOptions("pld", None, MAX_NEW), drafters=oracles)


async def _generate(client: EdgeClient, method: str, request: OpenRequest) -> list[int]:
    if method in PACES:
        result = await client.generate(replace(request, pace=PACES[method]))
        assert result.accepted_tokens > 0  # the oracle's drafts were verified, and kept
    else:
        result = await server_generate(client.link, request, Mode(method))
    return result.output_ids


def test_every_method_answers_the_rules_continuation_sessions_batched(paced):
    rule = paced.engine.rule
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64, max_sessions=8)
    with ServerThread(paced, ServerConfig(limits)) as server:
        async def run() -> dict[str, list[list[int]]]:
            async with _client(server.address, rule) as client:
                return {method: list(await asyncio.gather(*(
                    _generate(client, method, OpenRequest(prompt_ids=tuple(prompt),
                                                          max_new_tokens=MAX_NEW))
                    for prompt in PROMPTS))) for method in METHODS}
        done = asyncio.run(run())
        registry = server.service.metrics.registry
        passes = registry.get_sample_value("splitdec_model_forwards_total")
        carried = registry.get_sample_value("splitdec_batch_sessions_sum")
    expected = [rule.continuation(prompt, MAX_NEW) for prompt in PROMPTS]
    assert all(done[method] == expected for method in METHODS), done
    assert carried > passes  # some forward carried several sessions


def test_host_overhead_paced_runs_end_to_end():
    """benchmarks/host_overhead.py --paced-ms at a tiny size, through its own server process;
    it writes into the results directory, so under a scratch name, removed after."""
    results = ROOT / "benchmarks" / "results"
    try:
        subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--paced-ms", "1",
                        "--sessions", "1,2", "--max-new-tokens", "8", "--methods",
                        ",".join(METHODS), "--server-cores", "", "--client-cores", "",
                        "--name", "scratch_host_paced"], check=True, cwd=ROOT)
        result = json.loads((results / "scratch_host_paced.json").read_text())
        assert (results / "scratch_host_paced.png").is_file()
    finally:
        for path in results.glob("scratch_host_paced.*"):
            path.unlink()
    assert result["differing"] == 0
    assert [(r["method"], r["sessions"]) for r in result["rows"]] == [
        (m, n) for n in (1, 2) for m in METHODS]
    assert all(0 < r["share of ideal"] <= 1 for r in result["rows"])  # no forward beats its hold
