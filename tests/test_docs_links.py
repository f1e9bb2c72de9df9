"""Every relative link in the README, docs/ and the results log resolves inside the repository,
so a clone carries its documentation whole."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted(ROOT.glob("*/README.md")), *sorted(ROOT.glob("*/*/README.md")),
         ROOT / "benchmarks" / "results" / "LOG.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{target} in {page.name} points outside the repo"
        assert path.exists(), f"{target} in {page.name} does not exist"
