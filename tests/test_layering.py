"""The packages call each other in one direction only: the server and the edge share `shared`
and never import each other; `shared` and `netsim` import neither. Read from the source, so a
lazy import inside a function counts too."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "cloud_server": {"edge_client", "netsim"},
    "edge_client": {"cloud_server"},
    "shared": {"cloud_server", "edge_client", "netsim"},
    "netsim": {"cloud_server", "edge_client", "shared"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package):
    files = [p for p in (ROOT / package).rglob("*.py") if "pb" not in p.relative_to(ROOT).parts]
    assert files, f"no sources under {package}/"
    wrong = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package])
             for p in files}
    assert not {f: w for f, w in wrong.items() if w}


def test_tests_never_import_benchmarks():
    """Benchmarks measure the product; tests check it. Neither leans on the other's code."""
    files = sorted((ROOT / "tests").glob("*.py"))
    assert not [str(p.relative_to(ROOT)) for p in files if "benchmarks" in imported_packages(p)]


def test_the_running_server_never_imports_training_code():
    code = ("import sys\nimport cloud_server.cli, cloud_server.server, cloud_server.service\n"
            "import cloud_server.drafter_serving\n"
            "bad = [m for m in sys.modules if m.startswith('cloud_server.training')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
