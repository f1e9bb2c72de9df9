"""A gRPC front-end process of `cloud-server --frontends N`: serves the port with gRPC (TLS, the
auth token, message-size limits, keepalive, the health service) and relays every SplitDecoding
call's messages, unparsed, to the engine process over frames (frames.py, relay.py).

Started by the engine (frontend_processes.py) as `python -m cloud_server.rpc.frontend`, its
settings as JSON on stdin; prints `bound PORT` once it serves. Several bind the same port
(SO_REUSEPORT, gRPC's default on Linux): the kernel spreads the connections over them. It
imports no torch. When the engine's link goes, every call still open ends UNAVAILABLE and the
process exits 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_server.rpc.frames import FrameStream, Kind, LinkClosed, opening, status
from cloud_server.rpc.health_check import SERVICE_NAME
from cloud_server.rpc.relay import METHODS, SERVICE, TAKEN
from cloud_server.rpc.security import Security
from shared import keepalive

GRACE_S = 5.0
ENGINE_GONE = "the server's engine process is gone"


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *keepalive.server_options(),
    ]


class EngineLink:
    """The calls of this process, multiplexed over its one link to the engine."""

    def __init__(self, link: FrameStream):
        self._link = link
        self._calls: dict[int, asyncio.Queue[tuple[Kind, bytes]]] = {}
        self._next = 0
        self.lost = False

    async def run(self) -> None:
        """Hands each frame to its call until the engine goes; then ends every call."""
        try:
            while True:
                call, kind, payload = await self._link.read()
                if (queue := self._calls.get(call)) is not None:
                    queue.put_nowait((kind, payload))
        except LinkClosed:
            self.lost = True
            for queue in self._calls.values():
                queue.put_nowait((Kind.STATUS, status("UNAVAILABLE", ENGINE_GONE)))

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, each relayed with gRPC's bytes as they are."""
        kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        handlers = {}
        for name, method in METHODS.items():
            make = kinds[(method.client_streaming, method.server_streaming)]
            handlers[method.name] = make(self._relayer(name, method.client_streaming,
                                                       method.server_streaming))
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _relayer(self, name: str, streams_in: bool, streams_out: bool):
        async def relay(request: Any, context: grpc.aio.ServicerContext) -> bytes | None:
            return await self._relay(name, streams_in, streams_out, request, context)
        return relay

    async def _relay(self, name: str, streams_in: bool, streams_out: bool, request: Any,
                     context: grpc.aio.ServicerContext) -> bytes | None:
        if self.lost:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_GONE)
        self._next += 1
        call, queue = self._next, asyncio.Queue[tuple[Kind, bytes]]()
        self._calls[call] = queue
        cert = context.auth_context().get("x509_pem_cert")
        ended = False
        pump = None
        try:
            self._link.send(call, Kind.OPEN, opening(name, context.peer(),
                                                     cert[0] if cert else None))
            if streams_in:
                pump = asyncio.get_running_loop().create_task(self._pump(call, context))
            else:
                self._link.send(call, Kind.MSG, request)
                self._link.send(call, Kind.END)
            response = None
            while True:
                kind, payload = await queue.get()
                if kind is Kind.STATUS:
                    ended = True
                    return await self._end(context, payload, response)
                if streams_out:
                    await context.write(payload)
                    self._link.send(call, Kind.TAKEN, TAKEN.pack(len(payload)))
                else:
                    response = payload
        except LinkClosed:
            ended = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_GONE)
        finally:
            del self._calls[call]
            if pump is not None:
                pump.cancel()
            if not ended and not self.lost:
                with contextlib.suppress(LinkClosed):  # the engine went meanwhile
                    self._link.send(call, Kind.CANCEL)
        return None

    @staticmethod
    async def _end(context: grpc.aio.ServicerContext, payload: bytes,
                   response: bytes | None) -> bytes | None:
        ended = json.loads(payload)
        if ended["code"] != "OK":
            await context.abort(grpc.StatusCode[ended["code"]], ended["details"])
        return response

    async def _pump(self, call: int, context: grpc.aio.ServicerContext) -> None:
        """The client's messages to the engine as they come, then its half-close. If the
        engine goes meanwhile, the call's own loop ends it."""
        with contextlib.suppress(LinkClosed):
            while (message := await context.read()) is not grpc.aio.EOF:
                self._link.send(call, Kind.MSG, message)
                await self._link.drain()
            self._link.send(call, Kind.END)


async def serve(settings: dict) -> int:
    """Serves until SIGTERM (then drains for GRACE_S) or until the engine goes. Ctrl-C's
    SIGINT, which reaches every process of the terminal's group, is the engine's to act on:
    it stops its front ends itself, and one gone early would be replaced meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    reader, writer = await asyncio.open_unix_connection(settings["socket"])
    link = EngineLink(FrameStream(reader, writer))
    pem = lambda key: None if settings[key] is None else settings[key].encode()  # noqa: E731
    security = Security(cert_chain=pem("cert_chain"), private_key=pem("private_key"),
                        auth_token=settings["auth_token"], client_ca=pem("client_ca"))
    server = grpc.aio.server(options=server_options(settings["max_message_bytes"]),
                             interceptors=security.interceptors())
    server.add_generic_rpc_handlers((link.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings['host']}:{settings['port']}"
    credentials = security.credentials()
    bound = (server.add_insecure_port(address) if credentials is None
             else server.add_secure_port(address, credentials))
    if bound == 0:
        print(f"cloud-server front end: error: cannot bind {address}", file=sys.stderr)
        return 1
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"bound {bound}", flush=True)
    engine = asyncio.get_running_loop().create_task(link.run())
    await asyncio.wait([engine, asyncio.ensure_future(stopping.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(0 if link.lost else GRACE_S)
    return 1 if link.lost else 0


def main() -> int:
    return asyncio.run(serve(json.load(sys.stdin)))


if __name__ == "__main__":
    sys.exit(main())
