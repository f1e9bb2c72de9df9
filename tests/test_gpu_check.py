"""The GPU check's own parts that run anywhere (scripts/gpu_check.sh), run as it runs them:
its smoke step and the random-weight target its first phase times."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_the_smoke_step_passes_here_and_names_the_versions():
    done = run("benchmarks.gpu_smoke", "--device", "cpu", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    assert "grpcio 1." in done.stdout and "gguf 0." in done.stdout
    assert "gpu_smoke: ok" in done.stdout


def test_the_smoke_step_can_print_its_versions_alone():
    done = run("benchmarks.gpu_smoke", "--versions")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu_smoke: Python ") and "static engine" not in done.stderr


def test_the_smoke_step_stops_with_one_line_without_cuda():
    if torch.cuda.is_available():
        return
    done = run("benchmarks.gpu_smoke", "--device", "cuda")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("gpu_smoke: FAILED: RuntimeError: torch sees no "
                                            "CUDA device")


def test_a_random_target_has_the_shape_and_tokenizer_of_its_source(tiny_model_dir, tmp_path):
    for out in ("a", "b"):
        done = run("benchmarks.random_target", str(tiny_model_dir), str(tmp_path / out),
                   "--seed", "7")  # the tiny model's own is 0
        assert done.returncode == 0, done.stderr
    a = tmp_path / "a"
    assert json.loads((a / "config.json").read_text())["hidden_size"] == json.loads(
        (tiny_model_dir / "config.json").read_text())["hidden_size"]
    assert (a / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    source, ours, again = (load_file(d / "model.safetensors")
                           for d in (tiny_model_dir, a, tmp_path / "b"))
    assert source.keys() == ours.keys()
    assert all(ours[k].shape == source[k].shape and torch.equal(ours[k], again[k]) for k in ours)
    assert not any(torch.equal(ours[k], source[k]) for k in ours if ours[k].dim() > 1)


def test_a_random_target_needs_a_config(tmp_path):
    done = run("benchmarks.random_target", str(tmp_path), str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip() == f"random_target: {tmp_path} holds no config.json"


def test_the_check_refuses_a_phase_it_does_not_have():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "phase9", "/tmp/x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "gpu_check: no phase phase9 (phase1 or phase2)\n"
