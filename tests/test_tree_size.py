"""The tracked tree is what travels to the GPU machine, at most 64 MiB a transfer with a kit of
wheels beside it (issue 62), so it stays within a budget of half that."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 32 * 2**20  # bytes: the sum of `git ls-files` sizes


def tracked_sizes() -> dict[str, int]:
    """Bytes of each tracked file in the work tree (one deleted but not yet committed counts 0)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not in a git checkout")
    paths = (ROOT / name for name in listed.split("\0") if name)
    return {str(p.relative_to(ROOT)): p.stat().st_size if p.is_file() else 0 for p in paths}


def test_the_tracked_tree_fits_its_budget():
    sizes = tracked_sizes()
    total = sum(sizes.values())
    largest = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in
                        sorted(sizes.items(), key=lambda item: -item[1])[:5])
    assert total <= BUDGET, (
        f"the tracked tree is {total / 2**20:.1f} MiB, over its {BUDGET / 2**20:.0f} MiB budget "
        f"(it travels whole to the GPU machine: issue 62); largest: {largest}. Keep large "
        "outputs out of git, requantize plots (pngquant --quality 70-95 --strip), keep "
        "drafters in the int8 form cloud_server/moa/weights.py saves, or raise the budget only "
        "with the device transfer's limit in view")
