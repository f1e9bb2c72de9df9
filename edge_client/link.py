"""The edge's link to the cloud server: one channel, a deadline on every call, keepalive.

Turns every gRPC failure into a LinkError whose message is one line a user can act on.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from edge_client.security import ClientSecurity
from shared import keepalive, progress, wire
from shared.messages import (
    ClientMessage, CloseRequest, GenerateRequest, ServerInfo, ServerMessage, Verdict,
)
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

GRPC_FRAME_BYTES = 5  # length-prefixed message header


class LinkError(Exception):
    """The server refused a request or broke the protocol; the message is one line.
    `code` is the gRPC status of a refusal, lower case ("invalid_argument"), or None."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class ServerUnreachable(LinkError):
    """No server answers at the address, or the connection to it died."""


@dataclass(frozen=True)
class LinkConfig:
    connect_timeout_s: float = 5.0
    # How long one resume attempt waits for the channel to come back and the server to answer.
    # Long enough to span a typical outage, so the resume goes out the moment the link is back
    # rather than at the next attempt; a link still down after it sends the client back to
    # waiting (and drafting) offline.
    resume_timeout_s: float = 10.0
    # One round includes the server's queue and forward pass; the prefill of a long prompt on
    # a CPU server is the slowest.
    round_timeout_s: float = 60.0
    # An artifact download's deadline: this, plus its announced size at `fetch_min_rate`
    # (bytes/s): the 20 MB MoA bundle needs 80 s at 3G's 2 Mbit/s, more than any fixed
    # deadline that still catches a dead link on a small file.
    fetch_timeout_s: float = 120.0
    fetch_min_rate: float = 100_000.0
    # Whole-generation deadline for the Decode stream.
    stream_timeout_s: float = 3600.0
    max_message_bytes: int = 16 * 1024 * 1024
    security: ClientSecurity = ClientSecurity()  # TLS and the auth token


def channel_options(config: LinkConfig, bulk: bool = False) -> list[tuple[str, int]]:
    """The generation's channel, or with `bulk` the downloads' (ServerLink._bulk_stub)."""
    if bulk:
        return [*_common_options(config),
                *keepalive.client_options(keepalive.BULK_PING_TIMEOUT_MS)]
    return [
        *_common_options(config),
        *keepalive.client_options(),
        # A ping's answer queues behind the data in flight, which BDP probing lets grow to
        # megabytes: a long prompt's MoA activations then held it past the ping timeout on
        # 3G. The fixed 64 KB window keeps that queue short, at some cost to such a prompt's
        # first token on slow links only (results log, `pacing_notes`).
        ("grpc.http2.bdp_probe", 0),
        # After a drop, the channel redials quickly instead of grpc's default 1 s to 120 s
        # backoff; the client's own reconnect loop (offline.py) paces the attempts. Leave
        # grpc.min_reconnect_backoff_ms alone: it is also the connect timeout, and at 100 ms a
        # 4G handshake never completes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 300),
    ]


def _common_options(config: LinkConfig) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes)]


# Codes that say the link or the server went away, not that the server refused the request:
# the client may reconnect and resume after these.
TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def status_error(code: grpc.StatusCode, details: str | None, address: str) -> LinkError:
    lines = (details or "").splitlines()
    text = lines[0] if lines else code.name
    if code in TRANSIENT_CODES:
        return ServerUnreachable(f"cannot reach the server at {address} ({text})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServerUnreachable(f"the server at {address} did not answer in time")
    name = code.name.lower()
    return LinkError(f"the server at {address} refused: {name}: {text}", code=name)


def link_error(err: grpc.aio.AioRpcError, address: str) -> LinkError:
    return status_error(err.code(), err.details(), address)


class ServerLink:
    def __init__(self, address: str, config: LinkConfig = LinkConfig()):
        self.address = address
        self.config = config
        self._channel = config.security.channel(address, channel_options(config))
        self._metadata = config.security.metadata()
        self._stub = pb_grpc.SplitDecodingStub(self._channel)
        self._bulk: grpc.aio.Channel | None = None  # downloads: opened on the first one
        self.draft_graphs = False  # drafts travel as draft graphs (set by the client)

    async def __aenter__(self) -> "ServerLink":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()
        if self._bulk is not None:
            await self._bulk.close()

    def _bulk_stub(self) -> pb_grpc.SplitDecodingStub:
        """Downloads run on a channel of their own, whose keepalive waits out a link full of
        the download's own data (keepalive.BULK_PING_TIMEOUT_MS); the generation's channel
        keeps its fast detection of a dead link."""
        if self._bulk is None:
            self._bulk = self.config.security.channel(self.address,
                                                      channel_options(self.config, bulk=True))
        return pb_grpc.SplitDecodingStub(self._bulk)

    async def info(self) -> ServerInfo:
        try:
            reply = await self._stub.Info(pb.InfoRequest(), timeout=self.config.connect_timeout_s,
                                          metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise link_error(err, self.address) from None
        return wire.info_from_proto(reply)

    async def fetch_artifact(self, name: str, sha256: str, size_bytes: int = 0) -> bytes:
        """Downloads an artifact in chunks and checks it against the sha256 Info announced;
        the deadline grows with the size Info announced (LinkConfig.fetch_min_rate). A bar
        shows the download on a terminal (shared/progress.py)."""
        parts: list[bytes] = []
        timeout = self.config.fetch_timeout_s + size_bytes / self.config.fetch_min_rate
        try:
            with progress.bar(size_bytes or None, name, bytes_=True) as shown:
                async for chunk in self._bulk_stub().FetchArtifact(
                        pb.FetchArtifactRequest(name=name), timeout=timeout,
                        metadata=self._metadata):
                    parts.append(chunk.data)
                    shown.update(len(chunk.data))
        except grpc.aio.AioRpcError as err:
            raise link_error(err, self.address) from None
        data = b"".join(parts)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise LinkError(f"artifact {name} from {self.address} failed its sha256 check")
        return data

    async def generate(self, request: GenerateRequest
                       ) -> AsyncIterator[tuple[ServerMessage, int]]:
        """A server-only generation (the baselines): each message with its size on the wire."""
        call = self._stub.Generate(wire.generate_to_proto(request),
                                   timeout=self.config.stream_timeout_s, metadata=self._metadata)
        try:
            async for raw in call:
                yield wire.server_from_proto(raw), raw.ByteSize() + GRPC_FRAME_BYTES
        except grpc.aio.AioRpcError as err:
            raise link_error(err, self.address) from None

    def decode(self, wait_for_ready: bool = False) -> "DecodeStream":
        """A Decode call. `wait_for_ready` (for a resume) waits for the channel to reconnect
        instead of failing at once, so the call goes out the moment the link is back; the first
        receive's timeout bounds the wait. Drafts travel as draft graphs when `draft_graphs`
        is set (the server must unroll them: ServerInfo.draft_graphs)."""
        call = self._stub.Decode(timeout=self.config.stream_timeout_s,
                                 wait_for_ready=wait_for_ready, metadata=self._metadata)
        return DecodeStream(call, self.address, self.config.round_timeout_s, self.draft_graphs)


class DecodeStream:
    """One Decode call: send domain messages, receive domain messages, count wire bytes and the
    messages sent.

    A caller cancelled while it sends or receives does not end the call (grpc.aio cancels the
    whole call with a cancelled read or write): the read or write goes on, and the next send
    or receive takes it up, so a caller that gives up on a generation can still close its
    session (`close_early`). Only `cancel` ends the call."""

    def __init__(self, call, address: str, round_timeout_s: float, graphs: bool = False):
        self._call = call
        self._address = address
        self._round_timeout_s = round_timeout_s
        self._graphs = graphs
        self._read: asyncio.Future | None = None  # a read no caller has taken yet
        self._write: asyncio.Future | None = None  # a write that may not have ended yet
        self.bytes_up = 0
        self.bytes_down = 0
        self.messages_up = 0

    async def send(self, msg: ClientMessage, timeout_s: float | None = None) -> None:
        """Sends within `timeout_s` (default: the round timeout); a call that waits for the
        channel to be ready blocks here while the link is down."""
        raw = wire.client_to_proto(msg, self._graphs)
        self.bytes_up += raw.ByteSize() + GRPC_FRAME_BYTES
        self.messages_up += 1
        timeout_s = timeout_s or self._round_timeout_s
        try:
            await asyncio.wait_for(self._write_after_the_last(raw), timeout_s)
        except asyncio.TimeoutError:
            self._call.cancel()
            raise ServerUnreachable(f"could not send to the server at {self._address} within "
                                    f"{timeout_s:g} s") from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise await self._write_failed() from None

    async def recv(self, timeout_s: float | None = None) -> ServerMessage:
        """The next message, within `timeout_s` (default: the round timeout) a part; a Verdict
        sent in parts (large activations) comes back joined."""
        msg = await self._recv_one(timeout_s)
        parts: list[Verdict] = []
        while isinstance(msg, Verdict) and msg.more:
            parts.append(msg)
            msg = await self._recv_one(timeout_s)
        if not parts:
            return msg
        if not isinstance(msg, Verdict):
            raise LinkError(f"protocol error from {self._address}: a Verdict's parts end "
                            f"with {type(msg).__name__}")
        return wire.join_parts([*parts, msg])

    async def _write_after_the_last(self, raw: pb.ClientMessage) -> None:
        """Writes once a write a cancelled caller left has ended: the call takes one at a
        time."""
        if self._write is not None:
            await asyncio.shield(self._write)
        self._write = _unobserved(self._call.write(raw))
        await asyncio.shield(self._write)
        self._write = None

    def _next_read(self) -> asyncio.Future:
        """The read a cancelled caller left, or a new one."""
        if self._read is None:
            self._read = _unobserved(self._call.read())
        return self._read

    async def _recv_one(self, timeout_s: float | None) -> ServerMessage:
        timeout_s = timeout_s or self._round_timeout_s
        try:
            raw = await asyncio.wait_for(asyncio.shield(self._next_read()), timeout_s)
        except asyncio.TimeoutError:
            self.cancel()
            raise ServerUnreachable(f"the server at {self._address} did not answer within "
                                    f"{timeout_s:g} s") from None
        except grpc.aio.AioRpcError as err:
            self._read = None
            raise link_error(err, self._address) from None
        self._read = None
        if raw is grpc.aio.EOF:
            raise await self._ended()
        self.bytes_down += raw.ByteSize() + GRPC_FRAME_BYTES
        try:
            return wire.server_from_proto(raw)
        except ValueError as err:
            raise LinkError(f"protocol error from {self._address}: {err}") from None

    async def _write_failed(self) -> LinkError:
        """A refusal when the server ended the call; otherwise the transport failed under the
        write, which grpc reports as INTERNAL "Internal error from Core"."""
        error = await self._ended()
        if await self._call.code() == grpc.StatusCode.INTERNAL:
            return ServerUnreachable(f"the link to the server at {self._address} broke")
        return error

    async def _ended(self) -> LinkError:
        code = await self._call.code()
        if code == grpc.StatusCode.OK:
            return LinkError(f"the server at {self._address} ended the generation early")
        return status_error(code, await self._call.details(), self._address)

    async def finish(self) -> None:
        """Half-closes after Done and waits for the server to end the call."""
        await self._call.done_writing()
        await asyncio.wait_for(self._call.code(), self._round_timeout_s)

    async def close_early(self, timeout_s: float) -> None:
        """Ends a session before its Done: says Close, half-closes and reads what the server
        still sends up to the end of the call, within `timeout_s`. The server then frees the
        session; a call that merely breaks keeps it for a resume."""
        async with asyncio.timeout(timeout_s):
            await self.send(CloseRequest(), timeout_s)
            await self._call.done_writing()
            while True:
                try:
                    raw, self._read = await self._next_read(), None
                except grpc.aio.AioRpcError:  # the call ended: the session ends with it
                    return
                if raw is grpc.aio.EOF:
                    return

    def cancel(self) -> None:
        self._call.cancel()
        for pending in (self._read, self._write):
            if pending is not None:
                pending.cancel()


def _unobserved(step) -> asyncio.Future:
    """A read or write of the call as a task of its own, whose failure is retrieved even when
    no caller is left to take it (the caller that took it up raises it)."""
    task = asyncio.ensure_future(step)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
