"""Network conditions: per-direction link profiles (delay, jitter, bandwidth), outages
scheduled or random, the named profiles, and the parsing of the `--network` / `--profile`
syntax. Pure data; the proxy (proxy.py) applies them."""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Iterator


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


MSS_BYTES = 1448  # TCP payload per packet on a 1500-byte MTU with timestamps
MIN_RTO_S = 0.2


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link. `delay_ms` is one-way; None bandwidth means unlimited."""

    delay_ms: float
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None
    loss_pct: float = 0.0  # packets lost; TCP resends each, one retransmission timeout later

    def __post_init__(self) -> None:
        _require(_is_nonnegative(self.delay_ms), f"delay must be >= 0 ms, got {self.delay_ms}")
        _require(_is_nonnegative(self.loss_pct) and self.loss_pct < 100,
                 f"loss must be in [0, 100) %, got {self.loss_pct}")
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

    def retransmission_s(self, nbytes: int, rng: random.Random) -> float:
        """The extra delay of `nbytes` on a lossy link: when any of its packets is lost, TCP
        resends it after one retransmission timeout (Linux: the round trip plus at least
        200 ms, RFC 6298's floor as Linux sets it), and what follows waits behind it."""
        if not self.loss_pct:
            return 0.0
        packets = max(1, math.ceil(nbytes / MSS_BYTES))
        if rng.random() >= 1 - (1 - self.loss_pct / 100) ** packets:
            return 0.0
        return MIN_RTO_S + 2 * self.delay_ms / 1000

    def describe(self) -> str:
        text = f"{self.delay_ms:g} ms"
        if self.jitter_ms:
            text += f" +-{self.jitter_ms:g} ms"
        if self.bandwidth_mbit is not None:
            text += f" {self.bandwidth_mbit:g} Mbit/s"
        if self.loss_pct:
            text += f" {self.loss_pct:g}% loss"
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
    def symmetric(cls, link: LinkProfile, **kwargs: Any) -> NetworkConditions:
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


# Named profiles, one-way delay (RTT = 2 x delay_ms), the same both ways. docs/architecture.md, Network simulation names
# the delays and 4G's numbers; the other jitters and bandwidths are typical values.
PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile(delay_ms=1, bandwidth_mbit=1000),
    "wifi": LinkProfile(delay_ms=10, jitter_ms=2, bandwidth_mbit=100),
    "5g": LinkProfile(delay_ms=20, jitter_ms=5, bandwidth_mbit=100),
    "4g": LinkProfile(delay_ms=50, jitter_ms=10, bandwidth_mbit=20),
    "3g": LinkProfile(delay_ms=150, jitter_ms=20, bandwidth_mbit=2),
    "satellite": LinkProfile(delay_ms=300, jitter_ms=10, bandwidth_mbit=10),
    # The same links with packet loss as measured on busy mobile networks (about 1-2% on
    # 3G/4G under load; long-distance Wi-Fi near its range 0.5%).
    "wifi-lossy": LinkProfile(delay_ms=10, jitter_ms=2, bandwidth_mbit=100, loss_pct=0.5),
    "4g-lossy": LinkProfile(delay_ms=50, jitter_ms=10, bandwidth_mbit=20, loss_pct=1),
    "3g-lossy": LinkProfile(delay_ms=150, jitter_ms=20, bandwidth_mbit=2, loss_pct=2),
}

_LINK_KEYS = {"delay": "delay_ms", "jitter": "jitter_ms", "bw": "bandwidth_mbit",
              "loss": "loss_pct"}
_OUTAGE_KEYS = {"outage_rate": "outage_rate_per_min", "outage_duration": "outage_duration_s"}
CONDITIONS_HELP = ("a profile name (" + ", ".join(PROFILES) + ") and/or KEY=VALUE items: "
                   "delay=MS, jitter=MS, bw=MBIT, loss=PERCENT (one-way, both directions; up_ or "
                   "down_ prefix for one), outage=START:DURATION (s), outage_rate=PER_MIN, outage_duration=S, "
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
                extra: dict[str, Any]) -> None:
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
    extra: dict[str, Any] = {}
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
