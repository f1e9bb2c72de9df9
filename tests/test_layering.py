"""The packages call each other in one direction only: the server and the edge share `shared`
and never import each other; `shared` and `netsim` import neither; no module imports itself
through others. Read from the source, so a lazy import inside a function counts too."""
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


def imported_modules(path: Path) -> set[str]:
    """Every dotted name `path` imports; `from a.b import c` gives a.b and a.b.c (c may be a
    module)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package):
    files = [p for p in (ROOT / package).rglob("*.py") if "pb" not in p.relative_to(ROOT).parts]
    assert files, f"no sources under {package}/"
    wrong = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & FORBIDDEN[package])
             for p in files}
    assert not {f: w for f, w in wrong.items() if w}


def test_no_import_cycles():
    """A circle (training's losses importing the trainer for its settings, once) means no
    module of it can be read, or loaded, alone."""
    files = {module_name(p): p for package in FORBIDDEN for p in (ROOT / package).rglob("*.py")
             if "pb" not in p.relative_to(ROOT).parts}
    graph = {name: (imported_modules(path) & files.keys()) - {name}
             for name, path in files.items()}
    assert not import_cycles(graph)


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not import_cycles({"a": {"b"}, "b": set()})


@pytest.mark.parametrize("package, forbidden", [("tests", "benchmarks"), ("benchmarks", "tests"),
                                                ("testkit", "tests"), ("testkit", "benchmarks")])
def test_tests_and_benchmarks_share_only_testkit(package, forbidden):
    """Benchmarks measure the product; tests check it. Neither leans on the other's code: what
    both need (the tiny model, CLI processes on free ports, the fuzzer) lives in `testkit`."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    assert not [str(p.relative_to(ROOT)) for p in files if forbidden in imported_packages(p)]


def test_the_running_server_never_imports_training_code():
    code = ("import sys\nimport cloud_server.cli, cloud_server.rpc.server, cloud_server.rpc.service\n"
            "import cloud_server.rpc.drafter_serving\n"
            "bad = [m for m in sys.modules if m.startswith('cloud_server.training')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
