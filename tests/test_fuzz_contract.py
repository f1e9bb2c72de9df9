"""Property-based fuzzing of the Decode contract (hypothesis; the strategies in `testkit/fuzzing.py`)
against a real server on the tiny model, with a healthy generation running beside the fuzzer:
every sequence of client messages, however malformed (bad parents, huge or negative ids, NaN and
negative q, unknown enum values, other protocol versions, opens after closes, resumes of unknown
sessions, wrong round and base lengths), ends with a clear status, never INTERNAL, UNKNOWN or a hang; the healthy text
stays exact; no session is left once the orphans' idle timeout has passed. `make test` runs a
small draw, `make test-all` the full one; the long run is `python -m benchmarks.reliability`
(ten thousand cases and more)."""
from __future__ import annotations

import pytest

from cloud_server.reference import plain_greedy
from shared.messages import Limits
from testkit.fuzzing import HEALTHY_PROMPT, Healthy, Tally, fuzz, mutated, sequences
from testkit.waiting import wait_until
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

# Cases per test: a small draw in `make test`, the full one in `make test-all` (marked slow).
EXAMPLES = [pytest.param(24, id="small"), pytest.param(300, id="full", marks=pytest.mark.slow)]
IDLE_TIMEOUT_S = 2
HEALTHY_TOKENS = 24


def internal_errors(server: ServerThread) -> float:
    """Calls the server itself ended INTERNAL (its metrics count them at the error boundary)."""
    registry = server.service.metrics.registry
    return registry.get_sample_value("splitdec_requests_refused_total", {"code": "internal"}) or 0


@pytest.fixture(scope="module")
def fuzz_server(tiny_target):
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=64,
                    max_new_tokens=64, max_sessions=8, session_idle_timeout_s=IDLE_TIMEOUT_S)
    with ServerThread(tiny_target, ServerConfig(limits)) as server:
        yield server


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzzed_message_sequences_get_clear_statuses(fuzz_server, tiny_target, examples):
    tally = Tally()
    healthy = Healthy(fuzz_server.address, HEALTHY_TOKENS)
    healthy.start()
    try:
        fuzz(fuzz_server.address, sequences, examples, tally)
    finally:
        healthy.stop.set()
        healthy.join(60)
    print(f"fuzzed {tally.sequences} sequences, {tally.messages} messages: {tally.summary()}")
    assert tally.sequences >= examples and tally.codes["OK"] > 0
    assert not internal_errors(fuzz_server), "the server failed internally"
    assert healthy.outputs and all(o == plain_greedy(tiny_target, HEALTHY_PROMPT, HEALTHY_TOKENS)
                                   for o in healthy.outputs)
    # the server's reaper drops the orphans within a quarter of the timeout past it
    wait_until(lambda: len(fuzz_server.service.sessions) == 0, IDLE_TIMEOUT_S + 10,
               "every session gone past its idle timeout")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_mutated_wire_bytes_get_clear_statuses(fuzz_server, examples):
    tally = Tally()
    fuzz(fuzz_server.address, mutated(), examples, tally)
    print(f"mutated: {tally.summary()}")
    assert tally.codes["INVALID_ARGUMENT"] > 0
    assert not internal_errors(fuzz_server), "the server failed internally"
