"""One call's messages as domain objects: protobuf is parsed on read and built on write here,
so the session code above sees neither protobuf nor gRPC's stream.

Reads end a session silent past the idle timeout; writes count the bytes into the metrics and
split a Verdict whose activations pass half the message limit into parts (wire.verdict_parts).
"""
from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError

from cloud_server.rpc.metrics import Metrics
from shared import wire
from shared.errors import InvalidRequest, OutOfOrder
from shared.messages import ClientMessage, Limits, ServerMessage, Verdict


class StreamBroken(Exception):
    """The client's stream died under a write: nobody is left to tell."""


class ClientStream:
    """The gRPC call `context` (a Decode stream, or Generate's response stream)."""

    def __init__(self, context, limits: Limits, metrics: Metrics):
        self.context = context
        self.limits = limits
        self.metrics = metrics

    async def read(self) -> ClientMessage | None:
        """The next client message as a domain object; None at the end of the stream."""
        idle_s = self.limits.session_idle_timeout_s
        try:
            raw = await asyncio.wait_for(self.context.read(), idle_s)
        except asyncio.TimeoutError:
            raise OutOfOrder(f"session idle for {idle_s} s; closed") from None
        except DecodeError as err:  # grpc parses the bytes on read: corrupt ones end up here
            raise InvalidRequest(f"not a splitdec.v1 ClientMessage: {err}") from None
        if raw is grpc.aio.EOF:
            return None
        self.metrics.received(raw.ByteSize())
        return wire.client_from_proto(raw, self.limits.max_tree_nodes)

    async def send(self, msg: ServerMessage) -> None:
        # Half the message limit for the activations leaves room for the rest of a Verdict.
        max_bytes = self.limits.max_message_bytes // 2
        parts = wire.verdict_parts(msg, max_bytes) if isinstance(msg, Verdict) else [msg]
        self.metrics.sent(msg, sum([await self._write(part) for part in parts]))

    async def _write(self, msg: ServerMessage) -> int:
        proto = wire.server_to_proto(msg)
        try:
            await self.context.write(proto)
            return proto.ByteSize()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # grpc raises its internal ExecuteBatchError here
            raise StreamBroken(str(err)) from None
