"""Decode streams of raw protobuf messages against a server, for tests of its contract at the
wire: what it answers to each message, and the status and words it refuses bad ones with."""
from __future__ import annotations

import grpc

from shared.messages import PROTOCOL_VERSION
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

PROMPT = [5, 6, 7]
BASE = len(PROMPT) + 1  # the prefill commits one token
CLOSE = pb.ClientMessage(close=pb.Close())


def open_msg(ids=PROMPT, **kw) -> pb.ClientMessage:
    """An Open of this protocol version unless `protocol_version` says otherwise."""
    kw.setdefault("protocol_version", PROTOCOL_VERSION)
    return pb.ClientMessage(open=pb.Open(input_ids=pb.TokenIds(ids=ids), **kw))


def draft_msg(round_id=1, base=BASE, tokens=(10,), parents=(-1,), **kw) -> pb.ClientMessage:
    return pb.ClientMessage(draft=pb.Draft(round_id=round_id, base_length=base,
                                           tokens=tokens, parents=parents, **kw))


def run_stream(address: str, messages: list[pb.ClientMessage]
               ) -> tuple[list[pb.ServerMessage], grpc.RpcError | None]:
    """Sends the messages, returns (responses, the RpcError or None)."""
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.SplitDecodingStub(channel).Decode(iter(messages), timeout=20)
        responses = []
        try:
            for r in call:
                responses.append(r)
        except grpc.RpcError as err:
            return responses, err
        return responses, None


def assert_refused(address: str, messages: list[pb.ClientMessage], code: grpc.StatusCode,
                   words: str) -> None:
    _, err = run_stream(address, messages)
    assert err is not None, "the server accepted bad input"
    assert err.code() == code, err.details()
    assert words in err.details()
