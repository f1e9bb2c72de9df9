"""Bad input gets a gRPC status with a clear message, and the server keeps serving."""
from __future__ import annotations

import queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.messages import PROTOCOL_VERSION, Limits
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc
from testkit.raw_stream import BASE, CLOSE, assert_refused, draft_msg, open_msg, run_stream

BAD_INPUTS = {
    "token over vocab": ([open_msg(), draft_msg(tokens=(100000,))], "INVALID_ARGUMENT", "outside"),
    "negative token": ([open_msg(), draft_msg(tokens=(-5,))], "INVALID_ARGUMENT", "outside"),
    "parent not earlier": ([open_msg(), draft_msg(tokens=(10, 11), parents=(-1, 1))],
                           "INVALID_ARGUMENT", "earlier node"),
    "parent far below root": ([open_msg(), draft_msg(tokens=(10,), parents=(-2,))],
                              "INVALID_ARGUMENT", "earlier node"),
    "parents length": ([open_msg(), draft_msg(tokens=(10, 11), parents=(-1,))],
                       "INVALID_ARGUMENT", "parents"),
    "empty tree": ([open_msg(), draft_msg(tokens=(), parents=())], "INVALID_ARGUMENT", "empty"),
    "oversize tree": ([open_msg(), draft_msg(tokens=tuple(range(10, 27)),
                                             parents=(-1,) * 17)], "INVALID_ARGUMENT", "limit"),
    "too deep": ([open_msg(), draft_msg(tokens=tuple(range(10, 19)),
                                        parents=tuple(range(-1, 8)))], "INVALID_ARGUMENT", "deep"),
    "graph alias to a later node": ([open_msg(), draft_msg(tokens=(10, 20, 11, 20),
                                                           parents=(-1, 0, -1, 2),
                                                           alias_nodes=(1,), alias_targets=(3,))],
                                    "INVALID_ARGUMENT", "earlier node"),
    "graph cycle": ([open_msg(), draft_msg(tokens=(10, 10), parents=(-1, 0), alias_nodes=(1,),
                                           alias_targets=(0,))], "INVALID_ARGUMENT", "cycle"),
    "duplicate sibling": ([open_msg(), draft_msg(tokens=(10, 10), parents=(-1, -1))],
                          "INVALID_ARGUMENT", "repeats"),
    "draft before open": ([draft_msg()], "FAILED_PRECONDITION", "no open session"),
    "draft after close": ([open_msg(), CLOSE, draft_msg()], "FAILED_PRECONDITION", "closed"),
    "draft ids that do not grow": ([open_msg(), draft_msg(round_id=2), draft_msg(round_id=2)],
                                   "FAILED_PRECONDITION", "must grow"),
    "stale base length": ([open_msg(), draft_msg(base=BASE - 1)], "FAILED_PRECONDITION",
                          "committed"),
    "second open": ([open_msg(), open_msg()], "FAILED_PRECONDITION", "already open"),
    "prompt over limit": ([open_msg(ids=[5] * 65)], "INVALID_ARGUMENT", "limit is 64"),
    "empty prompt": ([open_msg(ids=[])], "INVALID_ARGUMENT", "empty"),
    "prompt token out of range": ([open_msg(ids=[5, 4000])], "INVALID_ARGUMENT", "outside"),
    "no prompt": ([pb.ClientMessage(open=pb.Open(protocol_version=PROTOCOL_VERSION))],
                  "INVALID_ARGUMENT", "no prompt"),
    "max_new_tokens over limit": ([open_msg(max_new_tokens=65)], "INVALID_ARGUMENT",
                                  "max_new_tokens"),
    "empty client message": ([pb.ClientMessage()], "INVALID_ARGUMENT", "no open"),
    "activations without a drafter": ([open_msg(activations=pb.ACTIVATION_FORMAT_FP16)],
                                      "INVALID_ARGUMENT", "no drafter"),
    "protocol 1 client": ([open_msg(protocol_version=1)], "INVALID_ARGUMENT",
                          "the client speaks protocol 1, this server 2: upgrade the client"),
    "no protocol version (protocol 1)": ([open_msg(protocol_version=0)], "INVALID_ARGUMENT",
                                         "the client speaks protocol 1,"),
    "newer protocol": ([open_msg(protocol_version=3)], "INVALID_ARGUMENT",
                       "the client speaks protocol 3, this server 2"),
    "protocol 1 resume": ([open_msg(protocol_version=1, resume=pb.Resume(
        session_id="gone", generated_ids=(9,)))], "INVALID_ARGUMENT", "speaks protocol 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_server_keeps_serving(tiny_server, case):
    messages, code, words = BAD_INPUTS[case]
    held = len(tiny_server.service.sessions)  # orphans of other tests, waiting for a resume
    assert_refused(tiny_server.address, messages, getattr(grpc.StatusCode, code), words)
    responses, err = run_stream(tiny_server.address, [open_msg(), draft_msg(), CLOSE])
    assert err is None
    assert [r.WhichOneof("kind") for r in responses] == ["opened", "verdict", "verdict", "done"]
    assert len(tiny_server.service.sessions) <= held


def test_a_draft_from_a_verdict_that_said_rest_is_refused(tiny_server):
    """Auto pace starts from the client's round trip: at a minute, no draft can pay, and the
    first Verdict already tells the client to rest (Verdict.next). An acknowledgement from it
    is fine; a draft with tokens from it is refused, naming the rest."""
    feed: queue.Queue = queue.Queue()
    feed.put(open_msg(pace=pb.PACE_AUTO, lead=2, rtt_ms=60_000, max_new_tokens=40))
    with grpc.insecure_channel(tiny_server.address) as channel:
        replies = iter(pb_grpc.SplitDecodingStub(channel).Decode(iter(feed.get, None),
                                                                 timeout=20))
        assert next(replies).opened.pace == pb.PACE_AUTO
        first = next(replies).verdict
        assert first.next == pb.NEXT_REST and first.committed_length == BASE
        feed.put(draft_msg(1, BASE, (), ()))
        feed.put(draft_msg(2, BASE, (10,), (-1,)))
        with pytest.raises(grpc.RpcError) as err:
            for reply in replies:  # the forwards up to the lead, then the refusal
                assert reply.verdict.next == pb.NEXT_REST, reply
        feed.put(None)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "draft 2 continues 4 tokens, where the server said rest" in err.value.details()


def test_session_limit_answers_resource_exhausted(tiny_target):
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    with ServerThread(tiny_target, ServerConfig(Limits(max_sessions=3))) as server:
        assert_limit_refused(server, 3)


def assert_limit_refused(server, limit: int) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SplitDecodingStub(channel)
        feeds, calls = [], []
        for _ in range(limit):
            feed: queue.Queue = queue.Queue()
            feed.put(open_msg())
            call = stub.Decode(iter(feed.get, None), timeout=20)
            assert next(call).WhichOneof("kind") == "opened"
            feeds.append(feed)
            calls.append(call)
        assert_refused(server.address, [open_msg()], grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "limit")
        for feed, call in zip(feeds, calls):
            feed.put(CLOSE)
            feed.put(None)
            list(call)
    assert len(server.service.sessions) == 0


def test_unknown_artifact_is_not_found(tiny_server):
    with grpc.insecure_channel(tiny_server.address) as channel:
        stub = pb_grpc.SplitDecodingStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchArtifact(pb.FetchArtifactRequest(name="nope"), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_service_reports_serving(tiny_server):
    with grpc.insecure_channel(tiny_server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitdec.v1.SplitDecoding"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_idle_session_is_closed(tiny_target):
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    with ServerThread(tiny_target, ServerConfig(Limits(session_idle_timeout_s=1))) as server:
        with grpc.insecure_channel(server.address) as channel:
            feed: queue.Queue = queue.Queue()
            feed.put(open_msg())
            call = pb_grpc.SplitDecodingStub(channel).Decode(iter(feed.get, None), timeout=20)
            kinds = []
            with pytest.raises(grpc.RpcError) as err:
                for r in call:  # opened, verdict 0, then silence until the idle limit
                    kinds.append(r.WhichOneof("kind"))
            feed.put(None)
        assert kinds == ["opened", "verdict"]
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "idle" in err.value.details()
        assert len(server.service.sessions) == 0


def test_kv_budget_refuses_a_session_that_does_not_fit_then_admits_it(tiny_target):
    """One session's worst-case KV cache fits the budget, two do not: the second Open is
    refused RESOURCE_EXHAUSTED with a retry hint while the first is open, and admitted once
    the first has closed."""
    import asyncio

    from edge_client.link import LinkError, ServerLink
    from shared.messages import CloseRequest, Done, OpenRequest, Opened
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    request = OpenRequest(prompt_ids=(5, 6, 7, 8, 5, 6, 7), max_new_tokens=24)
    need = (len(request.prompt_ids) + 24 + limits.max_tree_nodes) * tiny_target.kv_bytes_per_token

    async def go() -> tuple[str, object]:
        async with ServerLink(server.address) as link:
            first = link.decode()
            await first.send(request)
            assert isinstance(await first.recv(), Opened)  # it holds its room
            second = link.decode()
            await second.send(request)
            with pytest.raises(LinkError, match="resource_exhausted") as refused:
                await second.recv()
            await first.recv()  # the prefill's Verdict
            await first.send(CloseRequest())
            assert isinstance(await first.recv(), Done)
            await first.finish()
            third = link.decode()
            await third.send(request)
            admitted = await third.recv()
            third.cancel()
            return str(refused.value), admitted

    config = ServerConfig(limits, kv_budget_bytes=need + need // 2)
    with ServerThread(tiny_target, config) as server:
        message, admitted = asyncio.run(go())
    assert "KV cache" in message and "retry" in message
    assert isinstance(admitted, Opened)
