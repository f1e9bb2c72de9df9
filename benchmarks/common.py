"""What every benchmark shares: the machine description, a running cloud-server, table output."""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from testkit.cli_harness import free_port  # every benchmark takes its ports from here

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads)")


# Sets the affinity, then runs the module as __main__: a process started so needs no
# preexec_fn, whose fork() in a client with live gRPC threads ran gRPC's fork handlers ("Other
# threads are currently calling into gRPC, skipping fork() handlers") and once left a netsim
# child that never printed its address. Without a preexec_fn, Python spawns with vfork.
_PIN_AND_RUN = ("import os, runpy, sys; "
                "os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
                "sys.argv = sys.argv[2:]; "
                "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def python_module(module: str, args: Sequence[str], cores: frozenset[int] | None,
                  **popen: Any) -> subprocess.Popen:
    """`python -m module args`, on `cores` only (None: anywhere) with as many compute threads
    as cores, so processes on separate cores do not slow each other: how a benchmark on one
    machine stands in for a server and laptops on separate ones."""
    if cores is None:
        return subprocess.Popen([sys.executable, "-m", module, *args], **popen)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    return subprocess.Popen([sys.executable, "-c", _PIN_AND_RUN,
                             ",".join(map(str, sorted(cores))), module, *args], env=env, **popen)


def parse_cores(text: str | None) -> frozenset[int] | None:
    """'0,1' -> {0, 1}; None or '' -> None."""
    return frozenset(int(c) for c in text.split(",")) if text else None


def add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-cores", help="run the server on these cores only (e.g. 0), with "
                   "one compute thread per core; default: anywhere")
    p.add_argument("--client-cores", help="run the edge clients on these cores only (e.g. 1): "
                   "laptops that do not take the server's cores; default: anywhere")


def placement(args: argparse.Namespace) -> str:
    """Where the processes ran, for a report's header."""
    parts = [f"the {who} on cores {cores} only" for who, cores in
             (("server", args.server_cores), ("clients", args.client_cores)) if cores]
    if not parts:
        return "server and clients sharing all cores"
    return f"{', '.join(parts)} (one compute thread per core)"


def cloud_server(*args: str, cores: frozenset[int] | None = None
                 ) -> contextlib.AbstractContextManager[str]:
    """A `cloud-server --port 0` process for the duration, on `cores` (None: any); yields
    HOST:PORT."""
    return module_server("cloud_server.cli", *args, cores=cores)


def module_server(module: str, *args: str, cores: frozenset[int] | None = None
                  ) -> contextlib.AbstractContextManager[str]:
    """`python -m module --port 0 args`, a server that answers as cloud-server does (its first
    line `listening on HOST:PORT`, SIGTERM to stop), for the duration, on `cores` (None: any);
    yields HOST:PORT."""
    return _listening(module, ["--port", "0", *args], cores)


def netsim_proxy(target: str, profile: str, outages: Sequence[tuple[float, float]] = (),
                 outage_mode: str | None = None, cores: frozenset[int] | None = None
                 ) -> contextlib.AbstractContextManager[str]:
    """A `netsim` proxy process to `target` under `profile`, with outages (start s, length s)
    after it starts; yields HOST:PORT. A process of its own, not a thread in the client's:
    there, every packet it releases would wait for the client's drafting to let go of the
    interpreter lock, and a link does not slow down while the edge drafts."""
    args = ["--target", target, "--profile", profile,
            *(f"--outage={start:g}:{length:g}" for start, length in outages)]
    return _listening("netsim.cli", args + (["--outage-mode", outage_mode] if outage_mode
                                            else []), cores)


@contextlib.contextmanager
def netsim_on_cue(target: str, profile: str, outage_s: float,
                  cores: frozenset[int] | None = None) -> Iterator[tuple[str, Callable[[], None]]]:
    """A `netsim` proxy process, as netsim_proxy starts, whose link drops when the caller says
    so: at a moment of the generation's, not the clock's. Yields HOST:PORT and a function that
    cuts the link for `outage_s` at once."""
    args = ["--target", target, "--profile", profile, f"--signal-outage={outage_s:g}"]
    with _started("netsim.cli", args, cores) as (address, proc):
        yield address, lambda: proc.send_signal(signal.SIGUSR1)


@contextlib.contextmanager
def _listening(module: str, args: list[str], cores: frozenset[int] | None) -> Iterator[str]:
    with _started(module, args, cores) as (address, _):
        yield address


@contextlib.contextmanager
def _started(module: str, args: list[str], cores: frozenset[int] | None
             ) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m module args` on `cores` until the block ends; yields the HOST:PORT of the
    `listening on HOST:PORT` line it prints first, and the process."""
    proc = python_module(module, args, cores, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"{module} did not start: {line!r}")
        yield line.removeprefix("listening on "), proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def write_results(name: str, text: str) -> None:
    """Prints a result's text and writes it to benchmarks/results/NAME.md."""
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def grouped_bars(path: Path, groups: Sequence[str], series: dict[str, list[float]],
                 ylabel: str, title: str, baseline: float | None = None) -> None:
    """A PNG with one cluster of bars per group and one bar per series in each cluster."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=label)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def stacked_bars(path: Path, labels: Sequence[str], parts: dict[str, list[float]], ylabel: str,
                 title: str) -> None:
    """A PNG with one bar per label, stacked from `parts` (name -> one value per label)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(parts) > 10  # past the default cycle's colours: 20 of them, the legend aside
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)) + 4 * many, 4.5))
    colors = plt.get_cmap("tab20").colors if many else [None] * len(parts)
    bottom = [0.0] * len(labels)
    for (part, values), color in zip(parts.items(), colors):
        ax.bar(labels, values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, **(dict(bbox_to_anchor=(1.01, 1), loc="upper left") if many else {}))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
