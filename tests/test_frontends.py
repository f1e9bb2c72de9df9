"""`cloud-server --frontends N`: gRPC in processes of its own, relaying to the engine over frames.

The contract's own tests run again here, imported, against servers whose calls all pass through
front-end processes: decoding equal to plain greedy, every bad input's status and words, resumes,
server-side generation, TLS, the token and mutual TLS (the caller's certificate crosses the
relay). Then what only the relay has: a front end that dies is replaced and its sessions wait for
a resume; an engine that goes ends every call UNAVAILABLE and its front ends exit.
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from cloud_server.config import ServerConfig
from cloud_server.rpc.frames import FrameStream, Kind, LinkClosed, opening
from cloud_server.rpc.frontend_processes import FrontEnds, socket_path
from cloud_server.rpc.relay import SERVICE, EngineRelay
from cloud_server.rpc.security import Security
from shared.messages import Limits
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from testkit.cli_harness import QUESTION, running_server
from testkit.raw_stream import open_msg
from testkit.waiting import wait_until
from tests.server_harness import ServerThread
from tests.test_metrics import test_metrics_follow_a_generation  # noqa: F401
from tests.test_resume_and_baselines import (  # noqa: F401 - run again through front ends
    test_a_broken_paced_stream_leaves_its_session_running_to_the_lead,
    test_resume_sends_what_a_lost_verdict_carried, test_server_side_generation_equals_plain_greedy,
    test_unknown_session_is_rebuilt_from_history)
from tests.test_security import (  # noqa: F401 - the same, and their fixtures
    mtls, pki, test_a_missing_or_wrong_token_is_refused,
    test_only_the_client_that_opened_a_session_may_resume_it,
    test_tls_and_token_from_the_cli_and_health_without_token,
    test_tls_with_the_token_generates_exactly)
from tests.test_server_errors import (  # noqa: F401
    test_a_draft_from_a_verdict_that_said_rest_is_refused,
    test_bad_input_is_refused_and_server_keeps_serving, test_health_service_reports_serving,
    test_unknown_artifact_is_not_found)
from tests.test_split_decoding_tiny import (  # noqa: F401
    test_concurrent_sessions_do_not_mix, test_split_greedy_equals_plain)

TINY = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=64, max_new_tokens=64,
              max_sessions=4, session_idle_timeout_s=5)


@pytest.fixture(scope="module")
def tiny_server(tiny_target):
    with ServerThread(tiny_target, ServerConfig(TINY), frontends=2) as server:
        yield server


@pytest.fixture(scope="module")
def isolated_server(tiny_target):
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64, max_sessions=16,
                    session_idle_timeout_s=5)
    with ServerThread(tiny_target, ServerConfig(limits), frontends=2) as server:
        yield server


def _secured(tiny_target, security: Security):
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    return ServerThread(tiny_target, ServerConfig(limits), security=security, frontends=2)


@pytest.fixture(scope="module")
def secure_server(tiny_target, pki):
    with _secured(tiny_target, Security.from_files(
            str(pki / "cert.pem"), str(pki / "key.pem"), str(pki / "token"))) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(tiny_target, pki, mtls):
    with _secured(tiny_target, Security.from_files(
            str(pki / "cert.pem"), str(pki / "key.pem"), None, str(mtls / "ca.pem"))) as server:
        yield server


def _open_and_hold(address: str, timeout_s: float = 30
                   ) -> tuple[str, list[int], grpc.Future, grpc.Channel]:
    """A Decode stream that opens a session and then stays open, sending nothing more."""
    channel = grpc.insecure_channel(address)
    outgoing: queue.Queue = queue.Queue()
    outgoing.put(open_msg(ids=[5, 6, 7], max_new_tokens=40))
    call = pb_grpc.SplitDecodingStub(channel).Decode(iter(outgoing.get, None),
                                                      timeout=timeout_s)
    opened, first = next(call), next(call)
    return opened.opened.session_id, list(first.verdict.tokens), call, channel


def _resumed(address: str, session: str, first: list[int]) -> bool:
    resume = open_msg(ids=[5, 6, 7], max_new_tokens=40,
                      resume=pb.Resume(session_id=session, generated_ids=first))
    with grpc.insecure_channel(address) as channel:
        answers = list(pb_grpc.SplitDecodingStub(channel).Decode(iter([resume]), timeout=30))
    return answers[0].opened.resumed


def test_a_call_past_its_deadline_ends_and_its_session_waits_for_a_resume(isolated_server):
    session, first, call, channel = _open_and_hold(isolated_server.address, timeout_s=1.0)
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    channel.close()
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: isolated_server.service.sessions.orphan(session) is not None, 3,
               "the front end's cancel to reach the engine's handler")
    assert _resumed(isolated_server.address, session, first)


class Hanging:
    """A service whose Decode waits until cancelled, and says so."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Decode(self, request, context) -> None:  # noqa: N802 - the RPC's name
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _handler_cancelled_by(end: str) -> bool:
    """Opens a Decode call on the engine's relay, then ends it as a front end would: `end`
    "cancel" sends CANCEL, "close" closes the link (the front end died)."""
    service = Hanging()
    relay, path = EngineRelay(service), socket_path()
    await relay.listen(path)
    link = FrameStream(*await asyncio.open_unix_connection(path))
    link.send(1, Kind.OPEN, opening(f"/{SERVICE.full_name}/Decode", "ipv4:127.0.0.1:1", None))
    await asyncio.sleep(0.1)
    if end == "cancel":
        link.send(1, Kind.CANCEL)
    else:
        link.close()
    try:
        await asyncio.wait_for(service.cancelled.wait(), 5)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        link.close()
        await relay.close()


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_a_call_its_front_end_ends_cancels_its_handler(end):
    assert asyncio.run(_handler_cancelled_by(end))


def test_a_message_over_the_limit_is_refused_by_the_front_end(tiny_server):
    huge = pb.ClientMessage(open=pb.Open(input_ids=pb.TokenIds(ids=[5]),
                                         stop_strings=["x" * (Limits().max_message_bytes + 1)]))
    with grpc.insecure_channel(tiny_server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.SplitDecodingStub(channel).Decode(iter([huge]), timeout=20))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_front_end_that_dies_is_replaced_and_its_sessions_wait_for_a_resume(tiny_target):
    with ServerThread(tiny_target, ServerConfig(TINY), frontends=1) as server:
        session, first, call, channel = _open_and_hold(server.address)
        killed = server.front_ends.processes[0]
        os.kill(killed.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as broken:
            list(call)
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        deadline = time.monotonic() + 30
        while server.front_ends.processes[0] is killed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.front_ends.processes[0] is not killed, "no front end replaced it"
        assert _resumed(server.address, session, first), "the session was not kept for a resume"
        assert not server.failures


async def _through_a_front_end_whose_engine_goes() -> tuple[grpc.aio.AioRpcError, int]:
    """A stand-in engine that takes the front end's link and closes it at the first call."""
    path = socket_path()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = FrameStream(reader, writer)
        try:
            while (await link.read())[1] is not Kind.OPEN:
                pass
        except LinkClosed:
            pass
        link.close()

    listener = await asyncio.start_unix_server(engine, path)
    front_ends = FrontEnds(1, path, "127.0.0.1", 0, Limits().max_message_bytes)
    port = await front_ends.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await pb_grpc.SplitDecodingStub(channel).Info(pb.InfoRequest(), timeout=20)
        code = await asyncio.wait_for(front_ends.processes[0].wait(), 20)
    finally:
        await front_ends.stop()
        listener.close()
    return ended.value, code


def test_calls_end_unavailable_when_the_engine_goes_and_the_front_end_exits():
    ended, code = asyncio.run(_through_a_front_end_whose_engine_goes())
    assert ended.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine process is gone" in ended.details()
    assert code == 1


def test_a_front_end_that_cannot_bind_fails_the_start():
    async def go() -> None:
        path = socket_path()
        listener = await asyncio.start_unix_server(lambda reader, writer: None, path)
        with socket.socket() as held:  # without SO_REUSEPORT: nobody else may bind it
            held.bind(("127.0.0.1", 0))
            held.listen()
            try:
                await FrontEnds(1, path, "127.0.0.1", held.getsockname()[1], 1 << 20).start()
            finally:
                listener.close()
    with pytest.raises(OSError, match="did not serve"):
        asyncio.run(go())


def test_frontends_below_zero_is_refused():
    proc = subprocess.run([sys.executable, "-m", "cloud_server.cli", "--frontends", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--frontends must be 0" in proc.stderr


@pytest.mark.slow
def test_the_real_model_through_two_front_ends_answers_as_in_process(tmp_path):
    """`cloud-server --frontends 2` on the real SmolLM2: split decoding with the MoA drafter
    (its bundle fetched through a front end), the plain API and server-side speculation give
    the same text, and the health command answers through a front end."""
    edge = [sys.executable, "-m", "edge_client.cli", "--max-new-tokens", "16"]
    env = {**os.environ, "SPLITDEC_CACHE": str(tmp_path / "edge-cache")}
    with running_server("--frontends", "2") as address:
        texts = [subprocess.run([*edge, "--server", address, *flags, QUESTION],
                                capture_output=True, text=True, timeout=300, env=env)
                 for flags in (["--drafter", "moa"], ["--mode", "plain-api"],
                               ["--mode", "server-spec", "--server-drafter", "recycle"])]
        health = subprocess.run([sys.executable, "-m", "cloud_server.cli", "health", "--server",
                                 address], capture_output=True, text=True, timeout=60)
    assert all(proc.returncode == 0 for proc in texts), [proc.stderr for proc in texts]
    assert "Paris" in texts[0].stdout
    assert texts[0].stdout == texts[1].stdout == texts[2].stdout
    assert health.returncode == 0, health.stderr
