"""The edge installed alone, as a user does it: `pip install .` into a fresh venv (the base
dependencies are the edge's: no extra). There the server's modules are absent, `edge-client`
answers a real server (through the venv's `netsim` too), `cloud-server` names the extra it
needs in one line, and the venv's size is printed for the README."""
from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from cloud_server.cli import CLOUD_EXTRA_MODULES
from testkit.cli_harness import QUESTION, first_line, running_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# The repository without what is local to this checkout: pip builds in the tree it is given
# (build/, *.egg-info), and a stale build/lib would put deleted modules into the wheel.
LOCAL_ONLY = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs")
# Past this the edge install has stopped being small (torch alone installs 750 MB here).
MAX_SIZE_MB = 400


@pytest.fixture(scope="module")
def edge_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install -c constraints.txt .` from a copy of this tree."""
    root = tmp_path_factory.mktemp("edge-install")
    source = shutil.copytree(REPO, root / "source", ignore=LOCAL_ONLY)
    venv.create(root / "venv", with_pip=True)
    install = subprocess.run([str(root / "venv" / "bin" / "python"), "-m", "pip", "install",
                              "-q", "-c", str(REPO / "constraints.txt"), str(source)],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr
    return root / "venv"


def run_in(edge_venv: Path, tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    """`command` from the venv's bin/, outside the repository (its sources not on sys.path), the
    edge's cache under `tmp_path`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SPLITDEC_CACHE"] = str(tmp_path / "edge-cache")
    return subprocess.run([str(edge_venv / "bin" / command[0]), *command[1:]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def size_mb(folder: Path) -> float:
    files = (p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    return sum(p.stat().st_size for p in files) / 1e6


def test_the_edge_venv_has_none_of_the_servers_modules(edge_venv, tmp_path):
    modules = sorted(CLOUD_EXTRA_MODULES)
    probe = ("import importlib.util, sys\n"
             f"present = [m for m in {modules} if importlib.util.find_spec(m)]\n"
             "sys.exit(f'present: {present}' if present else 0)\n")
    proc = run_in(edge_venv, tmp_path, "python", "-c", probe)
    assert proc.returncode == 0, proc.stderr


def test_the_edge_venv_is_small(edge_venv, capsys):
    size = size_mb(edge_venv)
    with capsys.disabled():  # into the log of `make test-all`: the figure the README quotes
        print(f"\nedge-only venv (pip install ., no torch): {size:.0f} MB")
    assert size < MAX_SIZE_MB


def test_edge_client_answers_a_real_server_directly_and_through_netsim(edge_venv, tmp_path):
    ask = ["--max-new-tokens", "12", QUESTION]
    with running_server() as address:
        direct = run_in(edge_venv, tmp_path, "edge-client", "--server", address, *ask)
        proxy = [str(edge_venv / "bin" / "netsim"), "--target", address, "--profile", "lan"]
        with first_line(proxy, "listening on ", 30) as via:
            proxied = run_in(edge_venv, tmp_path, "edge-client", "--server", via, *ask)
    assert direct.returncode == 0, direct.stderr
    assert "Paris" in direct.stdout and "tau" in direct.stderr
    assert any((tmp_path / "edge-cache" / "drafters").iterdir())  # the bundle, fetched
    assert proxied.returncode == 0, proxied.stderr
    assert proxied.stdout == direct.stdout


@pytest.mark.parametrize("args", [[], ["train-drafter", "--out", "x"], ["health"]])
def test_a_server_command_names_the_extra_to_install(edge_venv, tmp_path, args):
    proc = run_in(edge_venv, tmp_path, "cloud-server", *args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'splitdec[cloud]'" in lines[0], proc.stderr
