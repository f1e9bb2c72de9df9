"""The engine's gRPC front-end processes (`cloud-server --frontends N`): started, watched,
replaced when one dies, stopped with the server.

Each runs cloud_server/rpc/frontend.py with its settings on stdin. The first binds the port
asked for (0: any free one) and the rest bind the port it got. The engine's Unix socket lives in
a private temporary folder (mode 0700): a frame there is trusted as already checked by a front
end's auth, so no other user may connect to it.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import cloud_server
from cloud_server.rpc.frontend import GRACE_S
from cloud_server.rpc.security import Security

START_TIMEOUT_S = 60.0  # a front end imports grpc and binds: seconds on a loaded machine


def socket_path() -> str:
    return str(Path(tempfile.mkdtemp(prefix="splitdec-engine-")) / "engine.sock")


@dataclass
class FrontEnds:
    """`count` front ends serving `host`:`port`, relaying to the engine at `socket`."""

    count: int
    socket: str
    host: str
    port: int
    max_message_bytes: int
    security: Security = Security()
    on_failure: Callable[[str], None] = lambda why: None
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    _watchers: list[asyncio.Task] = field(default_factory=list)
    _stopping: bool = False

    async def start(self) -> int:
        """Starts them all; returns the bound port. OSError when one cannot serve."""
        for index in range(self.count):
            self.processes.append(await self._spawn(index))
        loop = asyncio.get_running_loop()
        self._watchers = [loop.create_task(self._watch(i)) for i in range(self.count)]
        return self.port

    async def stop(self) -> None:
        """SIGTERM to each (it drains its calls for GRACE_S), then waits for them to exit."""
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), GRACE_S + 5)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        root = str(Path(cloud_server.__file__).resolve().parents[1])
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cloud_server.rpc.frontend", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(self._settings()).encode())
        process.stdin.close()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        except asyncio.CancelledError:  # the server stops while this one starts
            process.kill()
            await process.wait()
            raise
        if not line.startswith(b"bound "):
            if process.returncode is None:
                process.kill()
            raise OSError(f"front end {index} did not serve {self.host}:{self.port} "
                          f"(exit {await process.wait()})")
        self.port = int(line.split()[1])
        return process

    def _settings(self) -> dict:
        text = lambda pem: None if pem is None else pem.decode()  # noqa: E731
        return {"socket": self.socket, "host": self.host, "port": self.port,
                "max_message_bytes": self.max_message_bytes,
                "cert_chain": text(self.security.cert_chain),
                "private_key": text(self.security.private_key),
                "client_ca": text(self.security.client_ca),
                "auth_token": self.security.auth_token}

    async def _watch(self, index: int) -> None:
        """A front end that exits while the server runs is replaced: its clients' streams
        broke, and they resume through another. One that cannot be replaced stops the
        server (`on_failure`)."""
        while not self._stopping:
            code = await self.processes[index].wait()
            if self._stopping:
                return
            print(f"front end {index} exited with {code}: starting another", file=sys.stderr,
                  flush=True)
            try:
                self.processes[index] = await self._spawn(index)
            except OSError as err:
                self.on_failure(str(err))
                return
