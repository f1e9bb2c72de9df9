"""The processes a process started, found by their command line in /proc (Linux)."""
from __future__ import annotations

from pathlib import Path


def children(pid: int, module: str) -> list[int]:
    """The processes `pid` started whose command line names `module`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == str(pid) and module.encode() in command:
            found.append(int(entry.name))
    return found
