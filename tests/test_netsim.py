"""The network simulator: injected delay, jitter, bandwidth and outages, measured through the proxy
against servers on loopback.

Timing checks are strict below and generous above: the proxy must never deliver early, but a
loaded machine makes everything late. The bounds still fail a delay paid once instead of twice,
twice instead of once, or in the wrong direction. Unloaded, the proxy is within ~1 ms of the
model (the numbers are in the docstring of netsim/)."""
from __future__ import annotations

import contextlib
import random
import select
import signal
import socket
import socketserver
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from netsim import (
    PROFILES, LinkProfile, NetworkConditions, Outage, OutageMode, ProxyThread, parse_conditions,
)
from netsim.conditions import MIN_RTO_S, outage_windows, parse_address
from testkit.waiting import wait_until

LOOPBACK = "127.0.0.1"
RECORD = struct.Struct("!Id")  # index, monotonic send time


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        # A proxy that stops or cuts resets its connections.
        with contextlib.suppress(ConnectionResetError):
            while data := self.request.recv(65536):
                self.request.sendall(data)


class _Source(socketserver.BaseRequestHandler):
    """Answers each 8-byte length with that many bytes."""

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError, EOFError):
            while True:
                header = _recv_exactly(self.request, 8)
                self.request.sendall(b"d" * struct.unpack("!Q", header)[0])


class _Stamper(socketserver.BaseRequestHandler):
    """Records the one-way latency of each RECORD the client sends."""

    latencies: list[float] = []

    def handle(self) -> None:
        while True:
            try:
                record = _recv_exactly(self.request, RECORD.size)
            except (EOFError, ConnectionResetError):
                return
            _, sent = RECORD.unpack(record)
            self.latencies.append(time.monotonic() - sent)


def _serve(handler: type[socketserver.BaseRequestHandler]) -> Iterator[str]:
    server = socketserver.ThreadingTCPServer((LOOPBACK, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    yield from _serve(_Echo)


@pytest.fixture(scope="module")
def source() -> Iterator[str]:
    yield from _serve(_Source)


@pytest.fixture()
def stamper() -> Iterator[str]:
    _Stamper.latencies = []
    yield from _serve(_Stamper)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = sock.recv(min(65536, n - got))
        if not data:
            raise EOFError(f"closed after {got} of {n} bytes")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _connect(address: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _round_trip_ms(sock: socket.socket, payload: bytes = b"x" * 100) -> float:
    start = time.monotonic()
    sock.sendall(payload)
    assert _recv_exactly(sock, len(payload)) == payload
    return (time.monotonic() - start) * 1000


def _not_early(measured: float, expected: float, early: float) -> bool:
    """Early by at most `early` (timer slack). Only a floor: a busy machine delivers late by any
    amount, so how much a delay adds, and no more, is checked on the schedule itself
    (`test_a_segment_trips_within_its_jitter_of_the_delay`)."""
    return measured >= expected - early


# --- conditions -------------------------------------------------------------------------------

def test_profiles_by_name_are_one_way_and_symmetric():
    conditions = parse_conditions("4g")
    assert conditions.up == conditions.down == PROFILES["4g"]
    assert conditions.up == LinkProfile(delay_ms=50, jitter_ms=10, bandwidth_mbit=20)
    assert conditions.rtt_ms == 100
    assert parse_conditions(" Satellite ").up.delay_ms == 300
    assert all(parse_conditions(name).up == link for name, link in PROFILES.items())


def test_explicit_numbers_overrides_and_outage_items():
    assert parse_conditions("delay=50,jitter=10,bw=20").up == PROFILES["4g"]
    assert parse_conditions("delay=7").down == LinkProfile(7)
    c = parse_conditions("4g,up_bw=5,down_delay=80")
    assert c.up == LinkProfile(50, 10, 5) and c.down == LinkProfile(80, 10, 20)
    c = parse_conditions("lan,outage=5:3,outage=1:0.5,outage_rate=2,outage_duration=4,"
                         "outage_mode=blackhole,seed=9")
    assert c.outages == (Outage(5, 3), Outage(1, 0.5))
    assert (c.outage_rate_per_min, c.outage_duration_s, c.seed) == (2, 4, 9)
    assert c.outage_mode is OutageMode.BLACKHOLE
    c = parse_conditions("4g,loss=1,down_loss=3")
    assert (c.up.loss_pct, c.down.loss_pct) == (1, 3)
    assert parse_conditions("4g-lossy").up == LinkProfile(50, 10, 20, loss_pct=1)


@pytest.mark.parametrize("text, fragment", [
    ("", "empty item"),
    ("4g,,bw=1", "empty item"),
    ("6g", "unknown network profile '6g'"),
    ("delay=fast", "delay: expected a number"),
    ("delay=-5", "delay must be >= 0"),
    ("jitter=nan", "jitter must be >= 0"),
    ("bw=0", "bandwidth must be > 0"),
    ("4g,lan", "expected KEY=VALUE"),
    ("latency=5", "unknown key 'latency'"),
    ("side_bw=5", "unknown key 'side_bw'"),
    ("outage=5", "expected START:DURATION"),
    ("outage=5:0", "outage duration must be > 0"),
    ("outage_mode=drop", "expected one of cut, blackhole"),
    ("seed=1.5", "seed: expected an integer"),
    ("loss=100", "loss must be in"),
    ("up_loss=-1", "loss must be in"),
])
def test_bad_conditions_fail_with_a_clear_message(text: str, fragment: str):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        parse_conditions(text)


def test_outage_windows_merge_overlaps_and_random_ones_follow_the_rate():
    scheduled = NetworkConditions(outages=(Outage(20, 1), Outage(5, 3), Outage(7, 2)))
    assert list(outage_windows(scheduled)) == [Outage(5, 4), Outage(20, 1)]
    rate = NetworkConditions(outage_rate_per_min=6, outage_duration_s=2, seed=3)
    first = [next(iter(outage_windows(rate))) for _ in range(2)]
    assert first[0] == first[1]  # seeded
    windows = outage_windows(rate)
    sample = [next(windows) for _ in range(2000)]
    gaps = [b.start_s - a.end_s for a, b in zip(sample, sample[1:])]
    assert min(gaps) > 0 and all(w.duration_s == 2 for w in sample)
    assert statistics.mean(gaps) == pytest.approx(10, rel=0.1)  # 60 s / 6 per minute


# --- delay, jitter, bandwidth -----------------------------------------------------------------

def test_round_trip_is_twice_the_one_way_delay(echo: str):
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=25))
    with ProxyThread(echo, conditions) as proxy, _connect(proxy.address) as sock:
        first = _round_trip_ms(sock)  # pays the simulated handshake too
        rtts = [_round_trip_ms(sock) for _ in range(15)]
    assert _not_early(statistics.median(rtts), 50, early=1), rtts
    assert first >= 99, "a new connection's first exchange waits one extra round trip"


def test_each_direction_has_its_own_delay(echo: str, stamper: str):
    conditions = NetworkConditions(up=LinkProfile(20), down=LinkProfile(60))
    with ProxyThread(echo, conditions) as proxy, _connect(proxy.address) as sock:
        _round_trip_ms(sock)
        rtts = [_round_trip_ms(sock) for _ in range(9)]
    with ProxyThread(stamper, conditions) as proxy, _connect(proxy.address) as sock:
        for i in range(16):
            sock.sendall(RECORD.pack(i, time.monotonic()))
            time.sleep(0.01)  # apart: each message delayed on its own
        wait_until(lambda: len(_Stamper.latencies) == 16, 5, "16 messages stamped")
    up_ms = [s * 1000 for s in _Stamper.latencies[1:]]  # the first paid the handshake
    assert _not_early(min(up_ms), 20, early=1), up_ms
    assert _not_early(min(rtts), 80, early=1), rtts


def test_jitter_stays_within_its_bounds(stamper: str):
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=20, jitter_ms=10), seed=1)
    with ProxyThread(stamper, conditions) as proxy, _connect(proxy.address) as sock:
        sock.sendall(RECORD.pack(0, time.monotonic()))  # handshake
        wait_until(lambda: len(_Stamper.latencies) == 1, 5, "the handshake stamped")
        # 30 ms apart, more than the jitter's whole range, so no message waits for another.
        for i in range(1, 31):
            sock.sendall(RECORD.pack(i, time.monotonic()))
            time.sleep(0.03)
        wait_until(lambda: len(_Stamper.latencies) == 31, 5, "31 messages stamped")
    one_way_ms = sorted(s * 1000 for s in _Stamper.latencies[1:])
    assert _not_early(one_way_ms[0], 20 - 10, early=1), one_way_ms


def test_a_segment_trips_within_its_jitter_of_the_delay():
    """The schedule the proxy delivers by: each segment's trip is the delay give or take up to
    the jitter, spread over that whole range, never below 0; serialization is bytes over the
    bandwidth."""
    rng = random.Random(3)
    trips_ms = [1000 * LinkProfile(delay_ms=20, jitter_ms=10).propagation_s(rng)
                for _ in range(2000)]
    assert 10 <= min(trips_ms) < 11 and 29 < max(trips_ms) <= 30
    assert 19 < statistics.median(trips_ms) < 21
    assert LinkProfile(delay_ms=2, jitter_ms=10).propagation_s(random.Random(0)) >= 0
    assert LinkProfile(delay_ms=20).propagation_s(rng) == 0.02
    assert LinkProfile(1, bandwidth_mbit=8).serialization_s(1000) == pytest.approx(0.001)
    assert LinkProfile(1).serialization_s(10**6) == 0.0


def test_loss_stalls_a_round_trip_by_one_retransmission_timeout(echo: str):
    """A lost packet costs TCP one retransmission timeout (RTT + 200 ms): at 30% loss about
    half the round trips stall that long, and every byte still arrives, in order."""
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=5, loss_pct=30), seed=4)
    with ProxyThread(echo, conditions) as proxy, _connect(proxy.address, timeout=10) as sock:
        _round_trip_ms(sock)
        rtts = [_round_trip_ms(sock) for _ in range(24)]
    assert sum(r >= 200 for r in rtts) >= 4, rtts  # a floor: a busy machine only adds stalls


def test_a_lost_packet_costs_one_retransmission_timeout_at_the_loss_rate():
    """The schedule behind the stalls above: a one-packet segment is lost at the loss rate and
    then waits one retransmission timeout, the round trip plus MIN_RTO_S."""
    profile = LinkProfile(delay_ms=5, loss_pct=30)
    rng = random.Random(4)
    extra_s = [profile.retransmission_s(100, rng) for _ in range(4000)]
    assert set(extra_s) == {0.0, MIN_RTO_S + 0.01}
    assert sum(e > 0 for e in extra_s) / len(extra_s) == pytest.approx(0.3, abs=0.03)


def test_jitter_never_reorders_or_corrupts_a_stream(echo: str):
    conditions = NetworkConditions.symmetric(LinkProfile(delay_ms=5, jitter_ms=10), seed=2)
    stream = b"".join(b"%07d\n" % i for i in range(20000))  # 160 KB, numbered
    with ProxyThread(echo, conditions) as proxy, _connect(proxy.address, timeout=10) as sock:
        def send() -> None:
            for i in range(0, len(stream), 500):  # many small writes, each with its own jitter
                sock.sendall(stream[i:i + 500])
                time.sleep(0.0005)
        sender = threading.Thread(target=send)
        sender.start()
        received = _recv_exactly(sock, len(stream))
        sender.join()
        stats = proxy.stats()
    assert received == stream
    assert stats.bytes_up == stats.bytes_down == len(stream)
    assert stats.chunks_up >= 50  # many reads, each with its own jitter samples


def test_bandwidth_paces_uploads_and_downloads(echo: str, source: str):
    size = 200 * 1024
    conditions = NetworkConditions(up=LinkProfile(1, bandwidth_mbit=8),
                                   down=LinkProfile(1, bandwidth_mbit=16))
    with ProxyThread(echo, conditions) as proxy, _connect(proxy.address, timeout=10) as sock:
        _round_trip_ms(sock, b"x")
        start = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(b"u" * size,))
        sender.start()
        _recv_exactly(sock, size)
        upload_s = time.monotonic() - start
        sender.join()
    with ProxyThread(source, conditions) as proxy, _connect(proxy.address, timeout=10) as sock:
        sock.sendall(struct.pack("!Q", 1))
        _recv_exactly(sock, 1)
        start = time.monotonic()
        sock.sendall(struct.pack("!Q", size))
        _recv_exactly(sock, size)
        download_s = time.monotonic() - start
    assert _not_early(upload_s, size * 8 / 8e6, early=0.005), upload_s  # 0.205 s
    assert _not_early(download_s, size * 8 / 16e6, early=0.005), download_s  # 0.102


# --- outages ----------------------------------------------------------------------------------

def test_cut_resets_connections_and_refuses_new_ones_until_it_ends(echo: str):
    # 3 s: the checks inside the outage keep seconds of margin on a busy machine
    conditions = NetworkConditions(outages=(Outage(0.4, 3.0),), outage_mode=OutageMode.CUT)
    with ProxyThread(echo, conditions) as proxy:
        with _connect(proxy.address) as sock:
            _round_trip_ms(sock)
            with pytest.raises((ConnectionResetError, EOFError)):
                _recv_exactly(sock, 1)  # blocks until the cut
        assert proxy.in_outage
        with pytest.raises(ConnectionRefusedError):
            _connect(proxy.address)
        wait_until(lambda: not proxy.in_outage, 5, "the outage over")
        with _connect(proxy.address) as sock:
            _round_trip_ms(sock)
        assert proxy.stats().outages == 1


def test_blackhole_stalls_everything_then_delivers_what_it_held(echo: str):
    conditions = NetworkConditions.symmetric(LinkProfile(5), outages=(Outage(0.4, 3.0),),
                                             outage_mode=OutageMode.BLACKHOLE)
    with ProxyThread(echo, conditions) as proxy:
        with _connect(proxy.address) as old:
            _round_trip_ms(old)
            wait_until(lambda: proxy.in_outage, 5, "the outage begun")
            old.sendall(b"held")
            with _connect(proxy.address, timeout=0.3) as new:  # accepted, then stalled
                new.sendall(b"late")
                for sock in (old, new):
                    sock.settimeout(0.3)
                    with pytest.raises(socket.timeout):
                        sock.recv(4)
                    sock.settimeout(5)
                assert proxy.in_outage
                assert _recv_exactly(old, 4) == b"held"
                assert _recv_exactly(new, 4) == b"late"
        assert not proxy.in_outage and proxy.stats().outages == 1


def test_an_unreachable_target_resets_the_client():
    with socket.socket() as closed:
        closed.bind((LOOPBACK, 0))
        target = f"{LOOPBACK}:{closed.getsockname()[1]}"  # bound, not listening: refuses
        with ProxyThread(target) as proxy:
            # The reset can beat connect() itself back to the client: either place is right.
            with pytest.raises((ConnectionResetError, EOFError)):
                with _connect(proxy.address) as sock:
                    _recv_exactly(sock, 1)
            assert proxy.stats().connections == 1


# --- the CLI ----------------------------------------------------------------------------------

def test_cli_prints_its_address_forwards_and_stops_on_sigterm(echo: str):
    proc = subprocess.Popen([sys.executable, "-m", "netsim.cli", "--target", echo,
                             "--profile", "lan"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "netsim printed nothing"
        line = proc.stdout.readline().strip()
        assert line.startswith(f"listening on {LOOPBACK}:"), line
        with _connect(line.removeprefix("listening on ")) as sock:
            _round_trip_ms(sock)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert "stopped: 1 connections" in proc.stderr.read()


def test_cli_cuts_the_link_when_signalled(echo: str):
    # 3 s: the refused connect inside the outage keeps seconds of margin on a busy machine
    proc = subprocess.Popen([sys.executable, "-m", "netsim.cli", "--target", echo,
                             "--profile", "lan", "--signal-outage", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "netsim printed nothing"
        address = proc.stdout.readline().strip().removeprefix("listening on ")
        with _connect(address) as sock:
            _round_trip_ms(sock)
            proc.send_signal(signal.SIGUSR1)
            with pytest.raises((ConnectionResetError, EOFError)):
                _recv_exactly(sock, 1)  # blocks until the cut
        with pytest.raises(ConnectionRefusedError):
            _connect(address)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert "1 outages" in proc.stderr.read()


def test_cli_bad_arguments_exit_2_with_one_line(echo: str):
    result = subprocess.run([sys.executable, "-m", "netsim.cli", "--target", echo,
                             "--profile", "6g"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown network profile '6g'" in result.stderr
