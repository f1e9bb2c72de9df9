"""The engine process's side of `--frontends N`: the service's calls as the front ends relay
them over frames (frames.py), served by the same handlers as gRPC's.

As vLLM V1 splits its API server from its engine loop: gRPC's own work (HTTP/2, the C-core's
threads, grpc.aio's Python, about 80 µs a message exchange, results log `wire_floor`) runs in
front-end processes on other cores, and the engine's event loop pays a frame's few µs. Each call
gets a `RelayedContext`, the part of grpc.aio's ServicerContext the handlers use (read, write,
abort, peer, auth_context), so sessions, errors, limits and metrics behave as served in
process. Auth, TLS, message-size limits, deadlines and the health service stay with gRPC in the
front ends; a call they end (cancelled, past its deadline, its stream broken) arrives as CANCEL
and cancels the handler, as grpc.aio does.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import struct
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError

from cloud_server.rpc.frames import FrameStream, Kind, LinkClosed, status
from shared.pb.splitdec.v1 import splitdec_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SplitDecoding"]
METHODS: dict[str, MethodDescriptor] = {f"/{SERVICE.full_name}/{m.name}": m
                                        for m in SERVICE.methods}
# A call's messages handed to its front end but not yet taken by gRPC: past this a write waits,
# as a grpc.aio write waits for the stream, so a slow link holds its session back, not memory.
WINDOW_BYTES = 256 * 1024
TAKEN = struct.Struct("<I")


class RelayedContext:
    """One relayed call, as its handler sees it."""

    def __init__(self, call: int, link: FrameStream, method: MethodDescriptor, opening: dict):
        self.id = call
        self._link = link
        self._request = message_factory.GetMessageClass(method.input_type)
        self._peer: str = opening["peer"]
        self._cert: str | None = opening["cert"]
        self._inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._unacked = 0
        self._taken = asyncio.Event()
        self.ended = False

    def deliver(self, payload: bytes | None) -> None:
        """A message from the client; None: it half-closed."""
        self._inbox.put_nowait(payload)

    def taken(self, size: int) -> None:
        self._unacked -= size
        self._taken.set()

    async def read(self) -> Any:
        """The next request message, parsed (DecodeError if it is not one), or grpc.aio.EOF."""
        raw = await self._inbox.get()
        if raw is None:
            self._inbox.put_nowait(None)  # every later read sees the end too
            return grpc.aio.EOF
        return self._request.FromString(raw)

    async def write(self, message: Any) -> None:
        data = message.SerializeToString()
        while self._unacked and self._unacked + len(data) > WINDOW_BYTES:
            self._taken.clear()
            await self._taken.wait()
        self._unacked += len(data)
        self._link.send(self.id, Kind.MSG, data)
        await self._link.drain()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.finish(code.name, details)
        raise grpc.aio.AbortError()

    def finish(self, code: str, details: str) -> None:
        if not self.ended:
            self.ended = True
            with contextlib.suppress(LinkClosed):
                self._link.send(self.id, Kind.STATUS, status(code, details))

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {} if self._cert is None else {"x509_pem_cert": [self._cert.encode()]}


class EngineRelay:
    """Serves the front ends' connections on a Unix socket with `service`'s handlers."""

    def __init__(self, service: Any):
        self.service = service
        self._server: asyncio.AbstractServer | None = None
        self._path: Path | None = None

    async def listen(self, path: str) -> None:
        """Listens on `path`, a socket in a folder of its own that close() removes."""
        self._server = await asyncio.start_unix_server(self._connection, path)
        self._path = Path(path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
                self._path.parent.rmdir()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        """One front end's calls until it goes; its calls still open are cancelled then, as
        grpc.aio cancels a handler whose client went away (a session waits for a resume)."""
        link = FrameStream(reader, writer)
        calls: dict[int, tuple[RelayedContext, asyncio.Task]] = {}
        try:
            while True:
                call, kind, payload = await link.read()
                if kind is Kind.OPEN:
                    self._open(link, calls, call, json.loads(payload))
                elif (entry := calls.get(call)) is not None:
                    self._route(entry, kind, payload)
        except LinkClosed:
            pass
        finally:
            for _, task in list(calls.values()):
                task.cancel()
            link.close()

    def _open(self, link: FrameStream, calls: dict, call: int, opening: dict) -> None:
        method = METHODS.get(opening["method"])
        if method is None:
            link.send(call, Kind.STATUS, status("UNIMPLEMENTED",
                                                f"no method {opening['method']}"))
            return
        context = RelayedContext(call, link, method, opening)
        task = asyncio.get_running_loop().create_task(self._serve(context, method))
        calls[call] = context, task
        task.add_done_callback(lambda _: calls.pop(call, None))

    @staticmethod
    def _route(entry: tuple[RelayedContext, asyncio.Task], kind: Kind, payload: bytes) -> None:
        context, task = entry
        if kind is Kind.MSG:
            context.deliver(payload)
        elif kind is Kind.END:
            context.deliver(None)
        elif kind is Kind.TAKEN:
            context.taken(TAKEN.unpack(payload)[0])
        elif kind is Kind.CANCEL:
            context.ended = True  # its front end has ended the call: no status goes back
            task.cancel()

    async def _serve(self, context: RelayedContext, method: MethodDescriptor) -> None:
        """Runs the method's handler as grpc.aio would: the request parsed for a unary
        request, the responses written as they come, then the status."""
        try:
            request = None if method.client_streaming else await context.read()
        except DecodeError as err:
            context.finish("INVALID_ARGUMENT", f"not a {method.input_type.full_name}: {err}")
            return
        try:
            result = getattr(self.service, method.name)(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    await context.write(response)
            elif (response := await result) is not None:
                await context.write(response)
            context.finish("OK", "")
        except grpc.aio.AbortError:
            pass  # the status went with the abort
        except LinkClosed:
            pass  # the front end is gone: nobody is left to tell
