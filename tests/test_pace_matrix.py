"""Every way the server decodes (cloud_server/decoding/decode_loop.py: lock-step, server pace, auto pace,
and server-side generation) under every acceptance rule, through the real server and client
on the tiny target with the MoA drafter: each text is exactly its reference, with drafts
accepted in lock-step and auto (made to find every draft worth its wait, since on the tiny
target it may rightly rest; its forwards are server pace's plus the waits, and server pace,
which waits for nothing, gets its drafts in on time only by chance). Greedy, and top-k or sampled drafts at temperature 0,
equal plain greedy decoding; the exponential race at temperature 0.9 equals token-by-token
race decoding under the target alone. (Sampling at temperature > 0 under the other rules is
tested statistically: test_acceptance_sampling.py.)"""
from __future__ import annotations

import pytest

from cloud_server.decoding.pacing import AutoPace
from cloud_server.reference import plain_greedy
from edge_client.client import ClientOptions
from edge_client.server_only import Mode
from shared.acceptance import AcceptanceMode
from shared.messages import Pace
from shared.sampling import SamplingParams
from testkit.moa_runs import run
from testkit.race_decoding import race_reference

PROMPTS = [(1, 46, 47, 48, 49), (1, 60, 61, 62)]
MAX_NEW = 24
RACE = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
RULES = {
    AcceptanceMode.GREEDY: SamplingParams(),
    AcceptanceMode.TOPK_DRAFTS: SamplingParams(seed=3),
    AcceptanceMode.SAMPLED_DRAFTS: SamplingParams(seed=3),
    AcceptanceMode.EXPONENTIAL_RACE: RACE,
}
WAYS = {"lockstep": (Mode.SPLIT, Pace.LOCKSTEP), "server": (Mode.SPLIT, Pace.SERVER),
        "auto": (Mode.SPLIT, Pace.AUTO), "server-spec": (Mode.SERVER_SPEC, None)}


def reference(target, prompt: tuple[int, ...], rule: AcceptanceMode) -> list[int]:
    if rule is AcceptanceMode.EXPONENTIAL_RACE:
        return race_reference(target, RACE, prompt, MAX_NEW)
    return plain_greedy(target, prompt, MAX_NEW)


@pytest.mark.parametrize("rule", list(RULES), ids=lambda rule: rule.value)
@pytest.mark.parametrize("way", list(WAYS))
def test_every_pace_under_every_rule_is_exact(moa_server, tiny_target, way, rule, tmp_path,  # noqa: F811
                                              monkeypatch):
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(AutoPace, "allowance_s", lambda self, busy, gain: 1.0)
    mode, pace = WAYS[way]
    options = ClientOptions("moa", 16, MAX_NEW, RULES[rule], rule, mode=mode, pace=pace)
    results = run(moa_server.address, options, PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert result.output_ids == reference(tiny_target, prompt, rule), (way, rule, prompt)
    if mode is Mode.SPLIT:
        assert {r.pace for r in results} == {pace}
    if pace in (Pace.LOCKSTEP, Pace.AUTO):
        assert sum(r.accepted_tokens for r in results) > 0, "no draft was accepted"
