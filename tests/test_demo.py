"""`make demo` keeps its promise: the real server and the edge answer one prompt three ways and
once through an outage, every text the plain API's, and the run ends with its table."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_demo_answers_every_way_losslessly_and_ends_with_its_table() -> None:
    run = subprocess.run([sys.executable, "scripts/demo.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stderr.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| plain-api", "| server-spec", "| split", "| split, the link down 2 s"]
    assert all(row.rstrip(" |").endswith("yes") for row in rows[1:])
    assert "every answer is the plain API's text" in run.stderr
