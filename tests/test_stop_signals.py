"""A long-running command stopped the moment it says it is ready drains and exits: cloud-server,
`edge-client serve` and netsim catch SIGTERM before they print their readiness line (the CI run of
3b0a2c0 killed a server that had printed `listening on` but not yet caught the signal)."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine, Iterator
from types import ModuleType

import pytest

from cloud_server.config import ServerConfig
from cloud_server.rpc import server as cloud_server
from cloud_server.rpc.server import build_service
from edge_client.client import ClientOptions
from edge_client.openai_compat import serving as edge_serving
from netsim import cli as netsim_cli
from netsim.conditions import NetworkConditions
from testkit.cli_harness import STARTUP_TIMEOUT_S

Serve = Callable[[], Coroutine[None, None, None]]


def missed(signum: int, _frame) -> None:
    raise AssertionError("the command printed its readiness line before it caught SIGTERM")


@pytest.fixture
def missed_stops() -> Iterator[None]:
    """A SIGTERM that reaches the process's own handler instead of the command's fails the
    test (without this handler it would kill pytest)."""
    previous = signal.signal(signal.SIGTERM, missed)
    yield
    signal.signal(signal.SIGTERM, previous)


def stop_when_ready(module: ModuleType, ready: str, monkeypatch) -> None:
    """Sends SIGTERM to this process as the command prints its readiness line."""
    def printing(*args, **kwargs) -> None:
        print(*args, **kwargs)
        if str(args[0]).startswith(ready):
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(module, "print", printing, raising=False)


def run_until_stopped(serve: Serve) -> None:
    asyncio.run(asyncio.wait_for(serve(), STARTUP_TIMEOUT_S))


@pytest.mark.usefixtures("missed_stops")
def test_cloud_server_stopped_as_it_listens_drains(tiny_target, monkeypatch):
    stop_when_ready(cloud_server, "listening on ", monkeypatch)
    service = build_service(tiny_target, ServerConfig())
    run_until_stopped(lambda: cloud_server.serve(service, "127.0.0.1", 0))


@pytest.mark.usefixtures("missed_stops")
def test_edge_serve_stopped_as_it_serves_drains(tiny_server, monkeypatch):
    stop_when_ready(edge_serving, "serving http://", monkeypatch)
    options = ClientOptions("pld", 1, 8)
    run_until_stopped(lambda: edge_serving.serve(tiny_server.address, options, "127.0.0.1", 0))


@pytest.mark.usefixtures("missed_stops")
def test_netsim_stopped_as_it_listens_stops(monkeypatch):
    stop_when_ready(netsim_cli, "listening on ", monkeypatch)
    run_until_stopped(lambda: netsim_cli.serve("127.0.0.1:0", "127.0.0.1:9",
                                               NetworkConditions()))


@pytest.mark.usefixtures("missed_stops")
def test_cloud_server_with_front_ends_stopped_as_it_listens_drains(tiny_target, monkeypatch):
    stop_when_ready(cloud_server, "listening on ", monkeypatch)
    service = build_service(tiny_target, ServerConfig())
    run_until_stopped(lambda: cloud_server.serve(service, "127.0.0.1", 0, frontends=2))


def test_ctrl_c_stops_the_server_and_its_front_ends_together(tiny_model_dir):
    """Ctrl-C reaches every process of the terminal's group: the front ends leave the stop to
    the server, which drains them and exits 0, none replaced and none left behind."""
    import subprocess
    import sys

    from testkit.cli_harness import first_line_of
    from testkit.processes import children

    proc = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--port", "0",
                             "--model", str(tiny_model_dir), "--drafter-dir", "none",
                             "--frontends", "2", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert first_line_of(proc, STARTUP_TIMEOUT_S).startswith("listening on ")
        front_ends = children(proc.pid, "cloud_server.rpc.frontend")
        assert len(front_ends) == 2
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "starting another" not in (proc.stderr.read() if proc.stderr else "")
    assert not any(os.path.exists(f"/proc/{pid}") for pid in front_ends)
