"""The CLIs as a user runs them: real processes, real ports."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from testkit.cli_harness import QUESTION, free_port, running_server

EDGE = [sys.executable, "-m", "edge_client.cli"]


def test_missing_server_is_one_line_and_nonzero_exit():
    proc = subprocess.run(EDGE + ["--server", f"127.0.0.1:{free_port()}", "hello"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the server" in lines[0], proc.stderr


def test_batch_with_missing_server_fails_cleanly(tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")
    proc = subprocess.run(EDGE + ["run", "--server", f"127.0.0.1:{free_port()}", "--prompts",
                                  str(prompts), "--out", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3 and "cannot reach" in proc.stderr


@pytest.mark.parametrize("args", [["--drafter", "nope"], ["--drafter", "recycle"],
                                  ["--offline-policy", "hope"],
                                  ["--offline-limit", "0"], ["--reconnect-timeout", "-1"],
                                  ["--tls-cert", "edge.pem"]])
def test_bad_arguments_exit_2(args):
    proc = subprocess.run(EDGE + ["--server", "x:1", *args, "hi"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()[-1:]) == 1


@pytest.mark.parametrize("args", [["--batch-tokens", "-1"], ["--dtype", "fp8"]])
def test_bad_server_arguments_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("cloud-server: error:")


# An edge-only install: the server's modules cannot be imported.
WITHOUT_CLOUD_EXTRA = """
import sys
class NoCloudExtra:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"torch", "grpc_health"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoCloudExtra())
from cloud_server.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args", [["--port", "0"], ["train-drafter", "--out", "x"]])
def test_server_without_its_extra_says_what_to_install(args):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_CLOUD_EXTRA, *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "splitdec[cloud]" in lines[0], proc.stderr


def test_health_command_answers_for_a_serving_server(tiny_server):
    health = [sys.executable, "-m", "cloud_server.cli", "health", "--timeout", "2"]
    ok = subprocess.run(health + ["--server", tiny_server.address],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run(health + ["--server", f"127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and len(down.stderr.strip().splitlines()) == 1, down.stderr
    unknown = subprocess.run(health + ["--server", tiny_server.address, "--service", "nope"],
                             capture_output=True, text=True, timeout=30)
    assert unknown.returncode == 1 and "not_found" in unknown.stderr


# "What is the capital of France?" opens with a near-tie for the model itself (top-2 gap 0.08 in
# fp32), which the 4-bit engine resolves the other way ("L'Étoile, ..."): a prompt it is sure of.


@pytest.mark.slow
def test_ask_and_batch_against_real_server(tmp_path):
    with running_server() as address:
        proc = subprocess.run(EDGE + ["--server", address, "--max-new-tokens", "12", QUESTION],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "Paris" in proc.stdout
        assert "tau" in proc.stderr and "server calls" in proc.stderr
        # The committed MoA drafter: bundle fetched from the server, paced (auto) with the
        # prompt's activation rows trailing the first Verdict; greedy, so the same answer.
        moa = subprocess.run(EDGE + ["--server", address, "--max-new-tokens", "12",
                                     "--drafter", "moa", QUESTION],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "SPLITDEC_CACHE": str(tmp_path / "edge-cache")})
        assert moa.returncode == 0, moa.stderr
        assert moa.stdout == proc.stdout
        assert any((tmp_path / "edge-cache" / "drafters").iterdir())
        # The baselines and every pace through the same simulated link: the same text.
        for flags in (["--mode", "plain-api"], ["--mode", "server-spec", "--drafter", "pld"],
                      ["--mode", "server-spec", "--server-drafter", "recycle"],
                      ["--pace", "lockstep"], ["--pace", "server", "--drafter", "pld"]):
            other = subprocess.run(EDGE + ["--server", address, "--max-new-tokens", "12",
                                           "--network", "lan", *flags, QUESTION],
                                   capture_output=True, text=True, timeout=300,
                                   env={**os.environ, "SPLITDEC_CACHE": str(tmp_path / "edge")})
            assert other.returncode == 0, (flags, other.stderr)
            assert other.stdout == proc.stdout, flags
            note = "edge-client: note: --mode server-spec does not read --drafter"
            assert (note in other.stderr) == (flags[:3] == ["--mode", "server-spec", "--drafter"])
        assert "[plain-api:" not in other.stderr and "[pld:" in other.stderr

        prompts = tmp_path / "in.jsonl"
        rows = [{"id": "a", "prompt": "Say hello."},
                {"id": "b", "messages": [{"role": "user", "content": "Count to three."}]},
                {"id": "c", "input_ids": [1, 4093, 198]},
                {"id": "d", "input_ids": [-5]}]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / "out.jsonl"
        proc = subprocess.run(EDGE + ["run", "--server", address, "--prompts", str(prompts),
                                      "--out", str(out), "--max-new-tokens", "8"],
                              capture_output=True, text=True, timeout=180)
        baseline_out = tmp_path / "plain.jsonl"
        plain = subprocess.run(EDGE + ["run", "--server", address, "--prompts", str(prompts),
                                       "--out", str(baseline_out), "--max-new-tokens", "8",
                                       "--mode", "plain-api", "--network", "lan"],
                               capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr  # one line was refused
    assert plain.returncode == 1, plain.stderr
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    baseline = {r["id"]: r for r in map(json.loads, baseline_out.read_text().splitlines())}
    for key in "abc":
        assert (records[key]["mode"], baseline[key]["mode"]) == ("split", "plain-api")
        assert records[key]["pace"] == "auto" and baseline[key]["pace"] is None
        assert baseline[key]["output_ids"] == records[key]["output_ids"]
    for key in "abc":
        for field in ("output_ids", "text", "rounds", "drafted_tokens", "accepted_tokens", "tau",
                      "wall_s", "ttft_s", "bytes_up", "bytes_down", "drafts_used",
                      "drafts_earned", "drafts_late", "drafts_wrong"):
            assert field in records[key], (key, field)
        assert 1 <= len(records[key]["output_ids"]) <= 8
    assert "outside" in records["d"]["error"]


@pytest.mark.slow
def test_silent_server_hits_the_deadline_not_a_hang():
    """A peer that accepts TCP and never answers: the client gives up at its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proc = subprocess.run(EDGE + ["--server", f"127.0.0.1:{port}", "hello"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_server_refuses_a_model_it_cannot_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", "--port", "0",
                           "--model", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("cloud-server: error:")
    assert proc.stdout == ""


@pytest.mark.slow
def test_any_local_checkpoint_serves_end_to_end(tiny_model_dir):
    """`--model PATH` with a transformers checkpoint the project has never seen."""
    with running_server("--model", str(tiny_model_dir)) as address:
        proc = subprocess.run(EDGE + ["--server", address, "--max-new-tokens", "20",
                                      "--drafter", "aded", "hello there"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tau" in proc.stderr and " tokens, " in proc.stderr


def test_network_profile_routes_through_netsim(tiny_server):
    proc = subprocess.run(EDGE + ["--server", tiny_server.address, "--network", "delay=20,bw=50",
                                  "--max-new-tokens", "8", "--no-chat-template", "hello"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[network:" in proc.stderr and "tau" in proc.stderr


def test_bad_network_spec_exits_2():
    proc = subprocess.run(EDGE + ["--server", "x:1", "--network", "dialup", "hi"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "network" in proc.stderr


@pytest.mark.slow
def test_long_prompt_with_moa_activations_over_3g(tmp_path):
    """A 500-token prompt's activations (600 KB) take 2.4 s at 3G's 2 Mbit/s. The keepalive
    ping's answer queues behind them: with the window BDP probing grew, the session dropped at
    every try and never got through (edge_client/link.py, channel_options)."""
    prompt = "Summarize in one sentence: " + " ".join(
        ["The quick brown fox jumps over the lazy dog near the river while the farmer watches."]
        * 25)
    env = {**os.environ, "SPLITDEC_CACHE": str(tmp_path / "edge-cache")}
    with running_server() as address:
        answers = [subprocess.run(EDGE + ["--server", address, "--max-new-tokens", "16",
                                          "--drafter", "moa", *network, prompt],
                                  capture_output=True, text=True, timeout=240, env=env)
                   for network in ([], ["--network", "3g", "--reconnect-timeout", "20"])]
    for proc in answers:
        assert proc.returncode == 0, proc.stderr
        assert "reconnects" not in proc.stderr, proc.stderr
    assert answers[0].stdout == answers[1].stdout


@pytest.mark.parametrize("flag, option", [("--draft-graphs", "draft_graphs"),
                                          ("--race-aware", "race_aware")])
def test_opt_in_drafting_flags_reach_the_client_options(flag, option):
    from edge_client.cli import options_from, parse_args

    assert getattr(options_from(parse_args(["--server", "x:1", flag, "hi"])), option)
    assert not getattr(options_from(parse_args(["--server", "x:1", "hi"])), option)


def test_the_tree_flag_reaches_the_client_options_of_every_command():
    from edge_client.cli import options_from, parse_args
    from edge_client.drafter_source import TreeShape

    for command in ([], ["run", "--prompts", "a", "--out", "b"], ["serve"]):
        argv = [*command, "--server", "x:1", "--drafter", "falcon", "--tree", "designed"]
        assert options_from(parse_args(argv + ["hi"] * (not command))).tree is TreeShape.DESIGNED
    assert options_from(parse_args(["--server", "x:1", "hi"])).tree is TreeShape.DYNAMIC


def test_a_designed_tree_without_a_trained_drafter_is_one_line_and_nonzero_exit(tiny_server):
    """A training-free drafter is refused before connecting (a usage error); 'auto' against a
    server that offers no trained drafter, once connected (what the server offers)."""
    for drafter, code, says in (("pld", 2, "pld has no designed tree"),
                                ("auto", 3, "offers no trained drafter")):
        proc = subprocess.run(EDGE + ["--server", tiny_server.address, "--drafter", drafter,
                                      "--tree", "designed", "hi"],
                              capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == code and len(lines) == 1, proc.stderr
        assert lines[0].startswith("edge-client: error:") and says in lines[0], proc.stderr


@pytest.mark.parametrize("argv, unread", [
    (["--mode", "plain-api", "--tree", "designed"], ["--tree"]),
    (["--mode", "server-spec", "--drafter", "moa", "--pace", "server"], ["--drafter", "--pace"]),
    (["--mode", "plain-api", "--server-drafter", "pld", "--tree-nodes", "8"],
     ["--tree-nodes", "--server-drafter"]),
    (["--server-drafter", "pld"], ["--server-drafter"]),
    (["--mode", "server-spec", "--server-drafter", "pld"], []),
    (["--drafter", "moa", "--pace", "server", "--draft-graphs"], []),
])
def test_flags_the_mode_does_not_read_are_named(argv, unread):
    from edge_client.cli import parse_args, unread_flags

    assert unread_flags(parse_args(["--server", "x:1", *argv, "hi"])) == unread
    assert unread_flags(parse_args(["run", "--server", "x:1", "--prompts", "a", "--out", "b",
                                    *argv])) == unread


def test_the_stats_line_says_what_became_of_a_paced_sessions_drafts():
    from edge_client.cli import stats_line
    from edge_client.reporting import DraftOutcomes
    from edge_client.reporting import GenerationResult

    paced = GenerationResult(output_ids=[1, 2, 3], rounds=2,
                             drafts=DraftOutcomes(used=3, earned=2, late=4, wrong=1))
    assert "drafts 3 used (2 earned), 4 late, 1 wrong" in stats_line(paced, "moa")
    assert "drafts" not in stats_line(GenerationResult(output_ids=[1], rounds=1), "pld")
