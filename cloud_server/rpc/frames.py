"""The wire between a gRPC front-end process and the engine process (`--frontends N`).

Each frame is a 9-byte header (payload length, call id, kind) and its payload, over one Unix
socket per front end, every call of that front end multiplexed on it. Messages travel as the
serialized protobuf gRPC carried, untouched: the front end never parses them. About 10 µs of
CPU an exchange against grpc.aio's 75-80 µs (results log, `wire_floor`), so the engine's core
pays the small part and the front ends' cores gRPC's.
"""
from __future__ import annotations

import asyncio
import enum
import json
import struct

HEADER = struct.Struct("<IIB")
# Past this many bytes waiting in the socket's buffer, a writer waits for it to drain.
HIGH_WATER_BYTES = 1 << 20


class Kind(enum.IntEnum):
    OPEN = 1  # front end -> engine: a call begins; payload Opening as JSON
    MSG = 2  # either way: one message of the call, serialized protobuf
    END = 3  # front end -> engine: the client half-closed its side
    CANCEL = 4  # front end -> engine: the call is over (cancelled, deadline, stream broke)
    STATUS = 5  # engine -> front end: the call ends; payload {"code": name, "details": str}
    TAKEN = 6  # front end -> engine: gRPC took a message of payload's 4-byte length


class LinkClosed(ConnectionError):
    """The other process closed the socket or died."""


def opening(method: str, peer: str, cert: bytes | None) -> bytes:
    """OPEN's payload: the method's full name, the client's address as gRPC names it, and its
    certificate (PEM) under mutual TLS."""
    return json.dumps({"method": method, "peer": peer,
                       "cert": None if cert is None else cert.decode()}).encode()


def status(code: str, details: str) -> bytes:
    return json.dumps({"code": code, "details": details}).encode()


class FrameStream:
    """Frames over one connection's asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    async def read(self) -> tuple[int, Kind, bytes]:
        """The next frame: (call id, kind, payload); LinkClosed at the end."""
        try:
            size, call, kind = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            payload = await self._reader.readexactly(size) if size else b""
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            raise LinkClosed(str(err) or "the other process closed the link") from None
        return call, Kind(kind), payload

    def send(self, call: int, kind: Kind, payload: bytes = b"") -> None:
        """Queues a frame; `drain` waits while the socket's buffer is full."""
        if self._writer.is_closing():
            raise LinkClosed("the link is closed")
        self._writer.write(HEADER.pack(len(payload), call, kind) + payload)

    async def drain(self) -> None:
        if self._writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES:
            try:
                await self._writer.drain()
            except ConnectionError as err:
                raise LinkClosed(str(err)) from None

    def close(self) -> None:
        self._writer.close()
