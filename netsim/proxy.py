"""The proxy itself: forwards TCP connections under NetworkConditions (the model is in this
package's docstring). Runs on the caller's event loop."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from netsim.conditions import (
    Direction, LinkProfile, NetworkConditions, Outage, OutageMode, outage_windows, parse_address,
)

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024
# Small enough that a large write arrives progressively (8 KiB is 33 ms at 2 Mbit/s), large enough
# that a fast link is not a timer per packet.
SEGMENT_BYTES = 8 * 1024
# Like a router's queue: past it the proxy stops reading and the sender blocks in TCP flow
# control instead of the proxy buffering without limit.
QUEUE_LIMIT_BYTES = 1024 * 1024
LISTEN_BACKLOG = 128
ACCEPT_RETRY_S = 0.5


@dataclass(frozen=True)
class ProxyStats:
    """Counters since start. Bytes are those delivered; chunks are reads from the sender."""

    bytes_up: int
    bytes_down: int
    chunks_up: int
    chunks_down: int
    connections: int  # accepted, all time
    active_connections: int
    outages: int  # begun


@dataclass
class _Line:
    """One direction of the link, shared by every connection, so connections share bandwidth."""

    profile: LinkProfile
    free_at: float = 0.0  # when the line finishes serializing what it already has
    bytes: int = 0
    chunks: int = 0

    def transmit(self, nbytes: int, ready_at: float) -> float:
        """Serializes `nbytes` that are ready at `ready_at`; returns when the last bit leaves."""
        self.free_at = max(ready_at, self.free_at) + self.profile.serialization_s(nbytes)
        return self.free_at


class _Gate:
    """Whether the link passes traffic; closed during an outage."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.opened_at = -math.inf  # loop time the last outage ended

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self, now: float) -> None:
        self.opened_at = now
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()


class _Segment(NamedTuple):
    release_at: float  # loop time it may be written out
    arrived_at: float
    data: bytes  # b"" marks the sender's EOF


class _Pump:
    """One direction of one connection: `receive` stamps and schedules what the sender writes,
    `deliver` writes it out when due. Two tasks, so arrival stamps never wait on a release."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: _Line,
                 gate: _Gate, rng: random.Random, not_before: float):
        self._reader, self._writer, self._line, self._gate = reader, writer, line, gate
        self._rng = rng
        self._ready_at = not_before  # the handshake: nothing leaves before it
        self._last_release = not_before
        self._queue: deque[_Segment] = deque()
        self._queued_bytes = 0
        self._arrived = asyncio.Event()
        self._drained = asyncio.Event()

    def _schedule(self, data: bytes, arrived_at: float) -> None:
        sent = self._line.transmit(len(data), max(arrived_at, self._ready_at))
        profile = self._line.profile
        # max(): jitter or a retransmission may delay a segment behind its predecessor but never
        # let it overtake (TCP delivers in order: a lost packet holds back what follows).
        release = max(self._last_release, sent + profile.propagation_s(self._rng)
                      + profile.retransmission_s(len(data), self._rng))
        self._last_release = release
        self._queue.append(_Segment(release, arrived_at, data))
        self._queued_bytes += len(data)
        self._arrived.set()

    async def receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # A black hole leaves what the sender writes in its socket buffer, as unacknowledged
            # TCP data; it is read after the outage and then paced and delayed like any other.
            await self._gate.wait_open()
            data = await self._reader.read(READ_BYTES)
            now = loop.time()
            if not data:
                self._schedule(b"", now)
                return
            self._line.chunks += 1
            for i in range(0, len(data), SEGMENT_BYTES):
                self._schedule(data[i:i + SEGMENT_BYTES], now)
            while self._queued_bytes > QUEUE_LIMIT_BYTES:
                self._drained.clear()
                await self._drained.wait()

    def _due_at(self, segment: _Segment) -> float:
        """A segment in flight when a black hole began leaves one delay after it ends, as a
        retransmission would."""
        opened_at = self._gate.opened_at
        if segment.arrived_at < opened_at:
            return max(segment.release_at, opened_at + self._line.profile.delay_ms / 1000)
        return segment.release_at

    def _pop_due(self, now: float) -> tuple[bytes, bool]:
        """Everything due by `now`, and whether the sender's EOF was reached."""
        parts: list[bytes] = []
        while self._queue and self._due_at(self._queue[0]) <= now:
            segment = self._queue.popleft()
            if not segment.data:
                return b"".join(parts), True
            parts.append(segment.data)
            self._queued_bytes -= len(segment.data)
        self._drained.set()
        return b"".join(parts), False

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            elif not self._gate.is_open:
                await self._gate.wait_open()
            elif (wait := self._due_at(self._queue[0]) - loop.time()) > 0:
                await asyncio.sleep(wait)
            else:
                data, eof = self._pop_due(loop.time())
                if data:
                    self._line.bytes += len(data)
                    self._writer.write(data)
                    await self._writer.drain()
                if eof:
                    if self._writer.can_write_eof():
                        self._writer.write_eof()
                    return


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with an RST rather than a FIN, so the peer sees a broken link, not a clean close."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):  # the peer may have torn it down already
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket bound to an explicit port. A port the kernel picked (0)
    would be given up when a CUT stops listening, so a placeholder socket finds a free port and
    holds it while the real one binds to it too (both SO_REUSEADDR, neither listening yet)."""
    placeholder = None
    if port == 0:
        placeholder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        placeholder.bind((host, 0))
        port = placeholder.getsockname()[1]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    finally:
        if placeholder is not None:
            placeholder.close()
    return listener


class NetSimProxy:
    """Forwards `listen` -> `target` (both HOST:PORT, IPv4) under `conditions`; see the module
    docstring for the model. Runs on the caller's event loop: keep that loop free of long work,
    or its timers (every release) run late; ProxyThread gives the proxy a loop of its own."""

    def __init__(self, target: str, conditions: NetworkConditions = NetworkConditions(),
                 listen: str = "127.0.0.1:0"):
        self.conditions = conditions
        self._target = parse_address(target)
        self._listen_at = parse_address(listen)
        self._lines = {Direction.UP: _Line(conditions.up), Direction.DOWN: _Line(conditions.down)}
        self._gate = _Gate()
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()  # one per live connection
        self._outage_task: asyncio.Task | None = None
        self._scripted: set[asyncio.Task] = set()  # outages begun by outage_now()
        self._scripted_until: float | None = None  # loop time the scripted outage ends
        self._started_at = 0.0
        self._connections = 0
        self._outages = 0

    @property
    def address(self) -> str:
        """HOST:PORT clients should connect to; valid after start()."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        host, port = self._listener.getsockname()
        return f"{host}:{port}"

    @property
    def in_outage(self) -> bool:
        return not self._gate.is_open

    def stats(self) -> ProxyStats:
        up, down = self._lines[Direction.UP], self._lines[Direction.DOWN]
        return ProxyStats(bytes_up=up.bytes, bytes_down=down.bytes, chunks_up=up.chunks,
                          chunks_down=down.chunks, connections=self._connections,
                          active_connections=len(self._tasks), outages=self._outages)

    async def start(self) -> int:
        """Binds and starts accepting; returns the port. Outage times count from here."""
        self._listener = _listen(*self._listen_at)
        self._started_at = asyncio.get_running_loop().time()
        self._accept_on()
        self._outage_task = asyncio.create_task(self._run_outages())
        return self._listener.getsockname()[1]

    async def stop(self) -> None:
        """Stops accepting, resets every connection and closes the listening socket."""
        if self._listener is None:
            return
        self._accept_off()
        tasks = [*self._tasks, *self._scripted] + ([self._outage_task] if self._outage_task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()
        self._listener = None

    @property
    def _listening(self) -> socket.socket:
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        return self._listener

    def _accept_on(self) -> None:
        asyncio.get_running_loop().add_reader(self._listening.fileno(), self._accept)

    def _accept_off(self) -> None:
        asyncio.get_running_loop().remove_reader(self._listening.fileno())

    def _accept(self) -> None:
        """Reader callback of the listening socket: synchronous, so stopping it leaves no accept
        half done (loop.sock_accept cancelled at the wrong moment can leak a socket)."""
        try:
            sock, _ = self._listening.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as err:  # out of descriptors, say: stop spinning, try again later
            log.warning("accept failed: %s; retrying in %.1f s", err, ACCEPT_RETRY_S)
            self._accept_off()
            asyncio.get_running_loop().call_later(ACCEPT_RETRY_S, self._accept_retry)
            return
        sock.setblocking(False)
        # The simulated link does its own pacing; Nagle would hold a small segment back until
        # the last one is acknowledged, and the peer delays that ACK up to 40 ms. asyncio sets
        # TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, which an accepted one is not.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connections += 1
        task = asyncio.create_task(self._serve(sock, self._connections))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accept_retry(self) -> None:
        cutting = self.in_outage and self.conditions.outage_mode is OutageMode.CUT
        if self._listener is not None and not cutting:
            self._accept_on()

    async def _serve(self, sock: socket.socket, index: int) -> None:
        """One client connection, from accept to close. A CUT or stop() cancels it."""
        writers: list[asyncio.StreamWriter] = []
        clean = False
        try:
            client_reader, client_writer = await asyncio.open_connection(sock=sock)
            writers.append(client_writer)
            await self._gate.wait_open()  # a black hole: the target sees nothing yet
            try:
                target_reader, target_writer = await asyncio.open_connection(*self._target)
            except OSError as err:
                log.warning("cannot reach the target %s:%d: %s", *self._target, err)
                return
            writers.append(target_writer)
            await self._forward(client_reader, client_writer, target_reader, target_writer, index)
            clean = True
        except* OSError as errors:  # a peer reset or went away: reset the other side too
            log.debug("connection %d: %s", index, errors.exceptions[0])
        finally:
            for writer in writers:
                if clean:
                    writer.close()
                else:
                    _reset(writer)

    async def _forward(self, client_reader: asyncio.StreamReader,
                       client_writer: asyncio.StreamWriter, target_reader: asyncio.StreamReader,
                       target_writer: asyncio.StreamWriter, index: int) -> None:
        """Pumps both directions until each has delivered its EOF; raises if either side fails."""
        handshake_done = asyncio.get_running_loop().time() + self.conditions.rtt_ms / 1000
        up = self._pump(client_reader, target_writer, Direction.UP, index, handshake_done)
        down = self._pump(target_reader, client_writer, Direction.DOWN, index, handshake_done)
        async with asyncio.TaskGroup() as group:
            for coroutine in (up.receive(), up.deliver(), down.receive(), down.deliver()):
                group.create_task(coroutine)

    def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              direction: Direction, index: int, not_before: float) -> _Pump:
        rng = random.Random(f"{self.conditions.seed}/{index}/{direction.value}")
        return _Pump(reader, writer, self._lines[direction], self._gate, rng, not_before)

    async def _run_outages(self) -> None:
        loop = asyncio.get_running_loop()
        for outage in outage_windows(self.conditions):
            await asyncio.sleep(self._started_at + outage.start_s - loop.time())
            await self._begin_outage(outage)
            await asyncio.sleep(self._started_at + outage.end_s - loop.time())
            self._end_outage()

    async def outage_now(self, duration_s: float) -> None:
        """An unscheduled outage from now for `duration_s`, in the conditions' mode: for tests
        that script an outage at a chosen moment of a generation. One that begins while another
        is under way extends it instead (outages never overlap)."""
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + duration_s
        if self._scripted_until is not None:
            self._scripted_until = max(self._scripted_until, ends_at)
            return
        self._scripted_until = ends_at
        this = asyncio.current_task()
        assert this is not None  # a coroutine runs in a task
        self._scripted.add(this)
        try:
            await self._begin_outage(Outage(loop.time() - self._started_at, duration_s))
            while (left := self._scripted_until - loop.time()) > 0:
                await asyncio.sleep(left)
            self._end_outage()
        finally:
            self._scripted_until = None
            self._scripted.discard(this)

    async def _begin_outage(self, outage: Outage) -> None:
        self._outages += 1
        self._gate.close()
        mode = self.conditions.outage_mode
        log.info("outage %d (%s) at %.1f s for %.1f s", self._outages, mode.value,
                 outage.start_s, outage.duration_s)
        if mode is OutageMode.CUT:
            self._accept_off()
            # Leaves the port bound but refuses connections and resets those not yet accepted.
            self._listening.shutdown(socket.SHUT_RD)
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _end_outage(self) -> None:
        if self.conditions.outage_mode is OutageMode.CUT:
            self._listening.listen(LISTEN_BACKLOG)
            self._accept_on()
        self._gate.open(asyncio.get_running_loop().time())
        log.info("outage %d over", self._outages)
