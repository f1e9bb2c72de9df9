"""The Decode contract fuzzed at length: hypothesis-drawn message sequences and mutated wire bytes
(the strategies of `testkit/fuzzing.py`) against a cloud-server process on the tiny model, while
a healthy greedy generation runs beside. Every call must end with a clear status; the healthy
text must stay exact; the server must neither fail internally, restart nor keep a session past
its idle timeout."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import cloud_server
from benchmarks.reliability import log, server_metrics
from cloud_server.reference import plain_greedy
from cloud_server.target import TargetModel
from testkit.cli_harness import free_port
from testkit.fuzzing import HEALTHY_PROMPT, Healthy, Tally, fuzz, mutated, sequences
from testkit.tiny_model import build_tiny_model

IDLE_TIMEOUT_S = 2
HEALTHY_TOKENS = 24
LIMITS = ("--max-tree-nodes", "16", "--max-prompt-tokens", "64", "--max-new-tokens", "64",
          "--max-sessions", "8", "--idle-timeout", str(IDLE_TIMEOUT_S))


def run_fuzz(cases: int) -> dict[str, object]:
    """Half the cases message sequences, half mutated bytes; returns the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp))
        expected = plain_greedy(TargetModel.load(str(model), "tiny", device="cpu"),
                                HEALTHY_PROMPT, HEALTHY_TOKENS)
        port = free_port()
        with cloud_server("--model", str(model), "--device", "cpu", "--drafter-dir", "none",
                          "--metrics-port", str(port), *LIMITS) as address:
            started = server_metrics(port)["process_start_time_seconds"]
            tallies = {"message sequences": Tally(), "mutated wire bytes": Tally()}
            failure, healthy, refused = fuzz_beside_healthy(address, cases, tallies)
            time.sleep(IDLE_TIMEOUT_S + 3)  # the orphans' idle timeout, and the reaper's round
            end = server_metrics(port)
    return {"tallies": tallies, "failure": failure,
            "healthy": len(healthy), "healthy refused": refused,
            "healthy exact": all(o == expected for o in healthy),
            "internal errors": end.get("splitdec_requests_refused_total{code=internal}", 0.0),
            "sessions left": end["splitdec_sessions_open"],
            "restarted": end["process_start_time_seconds"] != started}


def fuzz_beside_healthy(address: str, cases: int, tallies: dict[str, Tally]
                        ) -> tuple[str, list[list[int]], int]:
    """Fuzzes until done or the first unclear call: (that call, or "", the healthy outputs,
    the healthy Opens refused while the fuzzer's orphans filled the session table)."""
    healthy = Healthy(address, HEALTHY_TOKENS)
    healthy.start()
    failure = ""
    try:
        for (name, tally), strategy, n in zip(tallies.items(), (sequences, mutated()),
                                             (cases // 2, cases - cases // 2)):
            log(f"fuzz: {n} cases of {name}")
            fuzz(address, strategy, n, tally)
            log(f"fuzz: {name}: {tally.summary()}")
        if not healthy.is_alive():
            failure = "the healthy generation failed (its traceback is above)"
    except AssertionError as err:
        failure = str(err)[:500]
        log(f"fuzz: FAILED: {failure}")
    finally:
        healthy.stop.set()
        healthy.join(120)
    return failure, healthy.outputs, healthy.refused
