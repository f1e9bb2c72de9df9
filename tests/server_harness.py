"""Runs a real cloud-server (grpc.aio, in-process; or its engine in-process and gRPC in front-end
processes, `frontends`) on a free loopback port for tests."""
from __future__ import annotations

import asyncio
import threading

from cloud_server.config import ServerConfig
from cloud_server.rpc.security import Security
from cloud_server.rpc.server import build_service, start, start_relayed
from cloud_server.target import TargetModel


class ServerThread:
    """The server on its own event loop in a daemon thread; `address` is HOST:PORT."""

    def __init__(self, target: TargetModel, config: ServerConfig = ServerConfig(), port: int = 0,
                 security: Security = Security(), frontends: int = 0):
        self.service = build_service(target, config)
        self._security = security
        self._port = port
        self._frontends = frontends
        self.failures: list[str] = []  # front ends that died and could not be replaced
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.address = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        if self._frontends:
            starting = start_relayed(self.service, "127.0.0.1", self._port, self._security,
                                     self._frontends, self.failures.append)
            self.relay, self.front_ends, port = self._loop.run_until_complete(starting)
        else:
            self._server, port, _ = self._loop.run_until_complete(
                start(self.service, "127.0.0.1", self._port, self._security))
        self.address = f"127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        fut.result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _stop(self) -> None:
        if self._frontends:
            await self.front_ends.stop()
            await self.relay.close()
        else:
            await self._server.stop(0)
