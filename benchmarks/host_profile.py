"""Where a server's Python time goes, by component of its host path: py-spy samples the
process during a benchmark's cell, and each sample counts for the innermost frame that names a
component (issue 63: the profiles that decide the host path's redesign, before and after).

py-spy (`pip install py-spy`) reads the process from outside, without pausing it
(`--nonblocking`), from the caller's cores, and samples the thread that holds the GIL
(`--gil`): the server's Python, one thread at a time, where a thread waiting for the GIL, a
socket or a forward's hold is not sampled (without `--gil`, a thread woken from its poll but
waiting for a core counted as running there). gRPC's native threads hold no GIL: their CPU time
is in the caller's per-thread reading (benchmarks/server_cpu.py), not here; nor is Cython's,
which counts for the Python frame that called it.
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

RATE = 500  # samples a second
# Component, and the path fragments (or path fragment and function) of the frames that are it,
# tried from the innermost frame out; the first match names the sample.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("stand-in engine (rule, logits buffer)", ("testkit/paced_target.py",)),
    ("acceptance (argmax, greedy walk)", ("session.py:_accept", "shared/acceptance.py")),
    ("Token Recycling (top-k, table, tree)", ("session.py:_recycle", "decoding/recycling.py",
                                              "drafting/pld.py", "drafting/trie.py")),
    ("tree jobs, masks, positions", ("cloud_server/target.py", "shared/tree.py",
                                     "engine/interface.py")),
    ("forward building, re-rooting, budget", ("decoding/forward_builder.py",
                                              "shared/rerooting.py", "shared/draft_graph.py",
                                              "drafting/budget.py")),
    ("decode loop, pacing", ("decoding/decode_loop.py", "decoding/pacing.py",
                             "decoding/server_decoding.py")),
    ("batcher, model thread", ("decoding/batching.py", "cloud_server/model_thread.py",
                               "concurrent/futures/")),
    ("session bookkeeping (commit, Verdict)", ("decoding/session.py", "decoding/stops.py",
                                               "decoding/activation_rows.py")),
    ("metrics", ("rpc/metrics.py", "prometheus_client/")),
    ("wire codec (protobuf)", ("shared/wire.py", "shared/messages.py", "google/protobuf/")),
    ("frames to and from the front ends", ("rpc/frames.py", "rpc/relay.py",
                                           "asyncio/streams.py")),
    ("service, streams, inbox/outbox (and grpc.aio's Python)", ("cloud_server/rpc/",
                                                               "/grpc/")),
    ("event loop: polling (select)", ("/selectors.py",)),
    ("event loop: woken from another thread", ("selector_events.py:_write_to_self",
                                               "base_events.py:call_soon_threadsafe")),
    ("event loop: callbacks run in C (gRPC's Cython, futures)", ("asyncio/events.py:_run",)),
    ("event loop: other", ("/asyncio/",)),
)
OTHER = "other"


def component(frames: list[str]) -> str:
    """The component of one sample: `frames` root first, each 'function (path:line)'."""
    for frame in reversed(frames):
        function, _, where = frame.partition(" (")
        path = where.rsplit(":", 1)[0]
        for name, marks in COMPONENTS:
            for mark in marks:
                file, _, func = mark.partition(":")
                if file in path and (not func or function.rsplit(".", 1)[-1] == func):
                    return name
    return OTHER


def by_component(raw: str) -> Counter:
    """Samples by component, from py-spy's raw output (a stack and its count a line)."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            counts[component(stack.split(";")[1:])] += int(count)  # [0]: the thread
    return counts


@contextlib.contextmanager
def sampled(pid: int) -> Iterator[Counter]:
    """Samples `pid` for the duration of the block; the yielded Counter then holds the
    samples by component (RATE a second of a thread's running time)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    counts: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.txt"
        proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(RATE),
                                 "--format", "raw", "--threads", "--full-filenames",
                                 "--gil", "--nonblocking", "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            yield counts
        finally:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
            _, err = proc.communicate(timeout=30)
        if not out.is_file():
            raise RuntimeError(f"py-spy wrote nothing: {err.strip()}")
        counts.update(by_component(out.read_text()))
