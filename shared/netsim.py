"""User-space network simulator: a TCP proxy that adds delay, jitter, bandwidth limits and outages.

This kernel has no netem (DESIGN section 6), so the edge client reaches the server through this
proxy instead: `edge -> NetSimProxy (127.0.0.1:P) -> cloud-server`. The proxy knows nothing about
gRPC or the bytes it carries; it only decides when each byte may arrive.

The model, per direction (up = client -> target, down = target -> client):
- every chunk read from one side is cut into segments; a segment is serialized on the direction's
  line at `bandwidth_mbit` (one segment after another: a token bucket with no burst, shared by all
  connections like a real bottleneck), then propagates for `delay_ms` plus a uniform sample in
  [-jitter_ms, +jitter_ms];
- the bytes of one TCP stream are never reordered: a segment is released no earlier than the one
  before it, so jitter that would overtake a segment delays it instead;
- a new connection's first bytes wait one round trip, the TCP handshake;
- outages, scheduled or random, either cut every connection (CUT) or pass nothing (BLACKHOLE).
All delays are one-way: a profile's `delay_ms` is paid once up and once down, so a small request
and its answer take 2 x delay_ms (RTT = 2 x delay).

Measured here (2-core VM, unloaded, proxy on its own thread or process): a small message's round
trip is 2 x delay + 0.2-1.2 ms (the event loop's timers wake on millisecond boundaries), and
1-4 MB take their serialization time to within 1% at 2-100 Mbit/s and 5% at 1 Gbit/s. A loaded
machine only makes things later, never earlier.

Linux only: a CUT stops listening with shutdown(SHUT_RD) on the listening socket, which keeps the
port bound, so connecting during the outage is refused and the same port accepts again after.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import logging
import math
import random
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Coroutine, Iterator, NamedTuple

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
THREAD_TIMEOUT_S = 10.0


class OutageMode(Enum):
    """What an outage does to the connections through the proxy."""

    # Resets every connection (both sides) and refuses new ones: the link says it is down.
    CUT = "cut"
    # Forwards nothing, in either direction, and stalls new connections after accepting them:
    # only deadlines and keepalive notice. Held bytes are delivered one delay after the outage,
    # as TCP retransmissions would be, so a connection that nobody closed resumes intact.
    BLACKHOLE = "blackhole"


class Direction(Enum):
    UP = "up"  # client -> target
    DOWN = "down"  # target -> client


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_nonnegative(x: float) -> bool:
    return math.isfinite(x) and x >= 0


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link. `delay_ms` is one-way; None bandwidth means unlimited."""

    delay_ms: float
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None

    def __post_init__(self) -> None:
        _require(_is_nonnegative(self.delay_ms), f"delay must be >= 0 ms, got {self.delay_ms}")
        _require(_is_nonnegative(self.jitter_ms), f"jitter must be >= 0 ms, got {self.jitter_ms}")
        _require(self.bandwidth_mbit is None
                 or (math.isfinite(self.bandwidth_mbit) and self.bandwidth_mbit > 0),
                 f"bandwidth must be > 0 Mbit/s, got {self.bandwidth_mbit}")

    def propagation_s(self, rng: random.Random) -> float:
        """One segment's trip after serialization; jitter is clipped so it never goes below 0."""
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.delay_ms + jitter) / 1000

    def serialization_s(self, nbytes: int) -> float:
        if self.bandwidth_mbit is None:
            return 0.0
        return nbytes * 8 / (self.bandwidth_mbit * 1e6)

    def describe(self) -> str:
        text = f"{self.delay_ms:g} ms"
        if self.jitter_ms:
            text += f" +-{self.jitter_ms:g} ms"
        if self.bandwidth_mbit is not None:
            text += f" {self.bandwidth_mbit:g} Mbit/s"
        return text


@dataclass(frozen=True)
class Outage:
    """An outage `start_s` seconds after the proxy starts, lasting `duration_s`."""

    start_s: float
    duration_s: float

    def __post_init__(self) -> None:
        _require(_is_nonnegative(self.start_s), f"outage start must be >= 0 s, got {self.start_s}")
        _require(math.isfinite(self.duration_s) and self.duration_s > 0,
                 f"outage duration must be > 0 s, got {self.duration_s}")

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


NO_DELAY = LinkProfile(0.0)


@dataclass(frozen=True)
class NetworkConditions:
    """Both directions of the link plus its outages.

    Random outages: the up-time between the end of one and the start of the next is exponential
    with mean 60 / `outage_rate_per_min` seconds, and each lasts `outage_duration_s`; they are
    drawn from `seed`, as is the jitter, so a run can be repeated.
    """

    up: LinkProfile = NO_DELAY
    down: LinkProfile = NO_DELAY
    outages: tuple[Outage, ...] = ()
    outage_rate_per_min: float = 0.0
    outage_duration_s: float = 2.0
    outage_mode: OutageMode = OutageMode.CUT
    seed: int = 0

    def __post_init__(self) -> None:
        _require(_is_nonnegative(self.outage_rate_per_min),
                 f"outage rate must be >= 0 per minute, got {self.outage_rate_per_min}")
        _require(math.isfinite(self.outage_duration_s) and self.outage_duration_s > 0,
                 f"outage duration must be > 0 s, got {self.outage_duration_s}")

    @classmethod
    def symmetric(cls, link: LinkProfile, **kwargs: object) -> NetworkConditions:
        return cls(up=link, down=link, **kwargs)

    @property
    def rtt_ms(self) -> float:
        """Round trip of a small message, before jitter and serialization."""
        return self.up.delay_ms + self.down.delay_ms

    def describe(self) -> str:
        """One line for logs and benchmark tables."""
        links = (self.up.describe() if self.up == self.down
                 else f"up {self.up.describe()}, down {self.down.describe()}")
        parts = [links]
        parts += [f"outage at {o.start_s:g} s for {o.duration_s:g} s" for o in self.outages]
        if self.outage_rate_per_min:
            parts.append(f"{self.outage_rate_per_min:g} random outages/min of "
                         f"{self.outage_duration_s:g} s")
        if self.outages or self.outage_rate_per_min:
            parts.append(f"mode {self.outage_mode.value}")
        return ", ".join(parts)


# Named profiles, one-way delay (RTT = 2 x delay_ms), the same both ways. DESIGN section 6 names
# the delays and 4G's numbers; the other jitters and bandwidths are typical values.
PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile(delay_ms=1, bandwidth_mbit=1000),
    "wifi": LinkProfile(delay_ms=10, jitter_ms=2, bandwidth_mbit=100),
    "5g": LinkProfile(delay_ms=20, jitter_ms=5, bandwidth_mbit=100),
    "4g": LinkProfile(delay_ms=50, jitter_ms=10, bandwidth_mbit=20),
    "3g": LinkProfile(delay_ms=150, jitter_ms=20, bandwidth_mbit=2),
    "satellite": LinkProfile(delay_ms=300, jitter_ms=10, bandwidth_mbit=10),
}

_LINK_KEYS = {"delay": "delay_ms", "jitter": "jitter_ms", "bw": "bandwidth_mbit"}
_OUTAGE_KEYS = {"outage_rate": "outage_rate_per_min", "outage_duration": "outage_duration_s"}
CONDITIONS_HELP = ("a profile name (" + ", ".join(PROFILES) + ") and/or KEY=VALUE items: "
                   "delay=MS, jitter=MS, bw=MBIT (one-way, both directions; up_ or down_ prefix "
                   "for one), outage=START:DURATION (s), outage_rate=PER_MIN, outage_duration=S, "
                   "outage_mode=cut|blackhole, seed=N; e.g. '4g', 'delay=50,jitter=10,bw=20', "
                   "'4g,up_bw=5'")


def _number(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}: expected a number, got {text!r}") from None


def parse_outage(text: str) -> Outage:
    """`START:DURATION` in seconds, e.g. `5:3`."""
    start, sep, duration = text.partition(":")
    _require(bool(sep), f"outage: expected START:DURATION in seconds, got {text!r}")
    return Outage(_number("outage start", start), _number("outage duration", duration))


def parse_outage_mode(text: str) -> OutageMode:
    try:
        return OutageMode(text.strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in OutageMode)
        raise ValueError(f"outage mode: expected one of {choices}, got {text!r}") from None


def _parse_item(key: str, value: str, links: dict[Direction, dict[str, float]],
                extra: dict[str, object]) -> None:
    """Applies one KEY=VALUE item to the per-direction link fields or the conditions' fields."""
    prefix, _, name = key.partition("_")
    if key in _LINK_KEYS:
        for fields in links.values():
            fields[_LINK_KEYS[key]] = _number(key, value)
    elif prefix in ("up", "down") and name in _LINK_KEYS:
        links[Direction(prefix)][_LINK_KEYS[name]] = _number(key, value)
    elif key == "outage":
        extra["outages"] = extra.get("outages", ()) + (parse_outage(value),)
    elif key in _OUTAGE_KEYS:
        extra[_OUTAGE_KEYS[key]] = _number(key, value)
    elif key == "outage_mode":
        extra["outage_mode"] = parse_outage_mode(value)
    elif key == "seed":
        try:
            extra["seed"] = int(value)
        except ValueError:
            raise ValueError(f"seed: expected an integer, got {value!r}") from None
    else:
        raise ValueError(f"unknown key {key!r}; expected {CONDITIONS_HELP}")


def parse_conditions(text: str) -> NetworkConditions:
    """Parses a profile name, explicit numbers, or a name with overrides; see CONDITIONS_HELP.
    Raises ValueError with a message meant for the user."""
    items = [item.strip() for item in text.split(",")]
    _require(all(items), f"network conditions: empty item in {text!r}; expected {CONDITIONS_HELP}")
    base = NO_DELAY
    if "=" not in items[0]:
        name = items.pop(0).lower()
        _require(name in PROFILES,
                 f"unknown network profile {name!r}; expected one of {', '.join(PROFILES)}")
        base = PROFILES[name]
    links: dict[Direction, dict[str, float]] = {Direction.UP: {}, Direction.DOWN: {}}
    extra: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        _require(bool(sep), f"expected KEY=VALUE (a profile name only first), got {item!r}")
        _parse_item(key.strip().lower(), value.strip(), links, extra)
    return NetworkConditions(up=replace(base, **links[Direction.UP]),
                             down=replace(base, **links[Direction.DOWN]), **extra)


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); raises ValueError for anything else."""
    host, sep, port = text.rpartition(":")
    _require(bool(sep and host) and port.isdigit() and int(port) < 65536,
             f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _random_outages(conditions: NetworkConditions) -> Iterator[Outage]:
    if conditions.outage_rate_per_min <= 0:
        return
    rng = random.Random(f"{conditions.seed}/outages")
    t = 0.0
    while True:
        t += rng.expovariate(conditions.outage_rate_per_min / 60)
        yield Outage(t, conditions.outage_duration_s)
        t += conditions.outage_duration_s


def outage_windows(conditions: NetworkConditions) -> Iterator[Outage]:
    """Scheduled and random outages in start order, overlapping ones merged; endless when the
    rate is positive. Random outages never overlap each other, so every merge ends."""
    scheduled = sorted(conditions.outages, key=lambda o: o.start_s)
    merged = heapq.merge(scheduled, _random_outages(conditions), key=lambda o: o.start_s)
    current: Outage | None = None
    for outage in merged:
        if current is None:
            current = outage
        elif outage.start_s <= current.end_s:
            current = Outage(current.start_s, max(current.end_s, outage.end_s) - current.start_s)
        else:
            yield current
            current = outage
    if current is not None:
        yield current


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
        # max(): jitter may delay a segment behind its predecessor but never let it overtake.
        release = max(self._last_release, sent + self._line.profile.propagation_s(self._rng))
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
        parts = []
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

    def _accept_on(self) -> None:
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    def _accept_off(self) -> None:
        asyncio.get_running_loop().remove_reader(self._listener.fileno())

    def _accept(self) -> None:
        """Reader callback of the listening socket: synchronous, so stopping it leaves no accept
        half done (loop.sock_accept cancelled at the wrong moment can leak a socket)."""
        try:
            sock, _ = self._listener.accept()
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
        self._scripted.add(asyncio.current_task())
        try:
            await self._begin_outage(Outage(loop.time() - self._started_at, duration_s))
            while (left := self._scripted_until - loop.time()) > 0:
                await asyncio.sleep(left)
            self._end_outage()
        finally:
            self._scripted_until = None
            self._scripted.discard(asyncio.current_task())

    async def _begin_outage(self, outage: Outage) -> None:
        self._outages += 1
        self._gate.close()
        mode = self.conditions.outage_mode
        log.info("outage %d (%s) at %.1f s for %.1f s", self._outages, mode.value,
                 outage.start_s, outage.duration_s)
        if mode is OutageMode.CUT:
            self._accept_off()
            # Leaves the port bound but refuses connections and resets those not yet accepted.
            self._listener.shutdown(socket.SHUT_RD)
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _end_outage(self) -> None:
        if self.conditions.outage_mode is OutageMode.CUT:
            self._listener.listen(LISTEN_BACKLOG)
            self._accept_on()
        self._gate.open(asyncio.get_running_loop().time())
        log.info("outage %d over", self._outages)


class ProxyThread:
    """A NetSimProxy on an event loop of its own in a daemon thread, for synchronous callers and
    for callers whose own loop is busy (a drafter on it would make every release late).

        with ProxyThread("127.0.0.1:50051", parse_conditions("4g")) as proxy:
            connect to proxy.address
    """

    def __init__(self, target: str, conditions: NetworkConditions = NetworkConditions(),
                 listen: str = "127.0.0.1:0"):
        self.proxy = NetSimProxy(target, conditions, listen)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netsim",
                                        daemon=True)

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def in_outage(self) -> bool:
        return self.proxy.in_outage

    def stats(self) -> ProxyStats:
        return self.proxy.stats()

    def start_outage(self, duration_s: float) -> concurrent.futures.Future:
        """Begins an outage now without waiting for its end; the future resolves at the end
        (or is cancelled when the proxy stops first)."""
        return asyncio.run_coroutine_threadsafe(self.proxy.outage_now(duration_s), self._loop)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        try:
            self._call(self.proxy.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self.proxy.stop())
        finally:
            self._close_loop()

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(THREAD_TIMEOUT_S)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(THREAD_TIMEOUT_S)
        self._loop.close()
