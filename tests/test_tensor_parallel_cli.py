"""`cloud-server --tensor-parallel N` as a process: a count that does not split the model is
refused with one line naming those that do (exit 2); a rank killed mid-generation ends the
sessions UNAVAILABLE, the server exits 1 naming the rank, and no rank is left; a server killed
outright leaves no rank either."""
from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from testkit.raw_stream import open_msg

STARTUP_S = 180


def command(model_dir: Path, ranks: int) -> list[str]:
    return [sys.executable, "-m", "cloud_server.cli", "--model", str(model_dir), "--device",
            "cpu", "--tensor-parallel", str(ranks), "--drafter-dir", "none", "--port", "0",
            "--max-new-tokens", "900", "--quiet"]


def test_a_count_that_does_not_split_the_model_exits_2_naming_those_that_do(tiny_model_dir):
    proc = subprocess.run(command(tiny_model_dir, 3), capture_output=True, text=True,
                          timeout=STARTUP_S)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"cloud-server: error: {tiny_model_dir.name}: --tensor-parallel 3 does not divide the "
        "model's 4 attention heads, 2 KV heads and MLP width 128: 1 or 2 would")


def serving(model_dir: Path) -> tuple[subprocess.Popen, str, list[int]]:
    """A 2-rank server, once it listens: the process, its address and its ranks' pids."""
    proc = subprocess.Popen(command(model_dir, 2), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_S)
    assert ready, "the server did not start"
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("listening on "), line
    ranks = [int(pid) for path in glob.glob(f"/proc/{proc.pid}/task/*/children")
             for pid in Path(path).read_text().split()]
    assert len(ranks) == 1, ranks
    return proc, line.split()[-1], ranks


def gone_within(pid: int, timeout_s: float) -> bool:
    """Waits on the process's exit (a pidfd: it is not our child)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_rank_killed_mid_generation_ends_the_sessions_and_the_server(tiny_model_dir):
    """A generating session ends at once with the reason, one waiting for its client's
    draft when the server stops (the drain's end): both UNAVAILABLE."""
    proc, address, ranks = serving(tiny_model_dir)
    release = threading.Event()

    def idle() -> Iterator[pb.ClientMessage]:
        yield open_msg(pace=pb.PACE_LOCKSTEP)
        release.wait(STARTUP_S)

    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.SplitDecodingStub(channel)
            waiting = stub.Decode(idle(), timeout=STARTUP_S)
            assert next(waiting).HasField("opened")
            request = pb.GenerateRequest(open=open_msg(max_new_tokens=900).open)
            with pytest.raises(grpc.RpcError) as generating:
                for n, _ in enumerate(stub.Generate(request, timeout=STARTUP_S)):
                    if n == 4:
                        os.kill(ranks[0], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as waited:
                list(waiting)
    finally:
        release.set()
    assert generating.value.code() == grpc.StatusCode.UNAVAILABLE
    assert generating.value.details() == ("tensor parallel: rank 1 of 2 was killed (SIGKILL); "
                                          "the server is stopping")
    assert waited.value.code() == grpc.StatusCode.UNAVAILABLE
    assert proc.wait(STARTUP_S) == 1
    assert proc.stderr.read().strip().splitlines()[-1] == (  # type: ignore[union-attr]
        "cloud-server: error: tensor parallel: rank 1 of 2 was killed (SIGKILL); the server "
        "is stopping")
    assert gone_within(ranks[0], 0)


@pytest.mark.slow
def test_a_server_killed_outright_leaves_no_rank(tiny_model_dir):
    proc, _, ranks = serving(tiny_model_dir)
    proc.kill()
    proc.wait()
    assert gone_within(ranks[0], 30), "rank 1 outlived the server"
