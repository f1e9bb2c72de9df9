"""User-space network simulator: a TCP proxy that adds delay, jitter, bandwidth limits and outages.

This kernel has no netem (docs/architecture.md, "Network simulation"), so the edge client reaches the server through this
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

Modules: `conditions` (profiles, outages and their parsing), `proxy` (the asyncio proxy),
`thread` (the proxy on a thread of its own), `cli` (the `netsim` command).
"""
from netsim.conditions import (
    CONDITIONS_HELP, PROFILES, LinkProfile, NetworkConditions, Outage, OutageMode,
    parse_conditions,
)
from netsim.proxy import NetSimProxy, ProxyStats
from netsim.thread import ProxyThread

__all__ = ["CONDITIONS_HELP", "PROFILES", "LinkProfile", "NetSimProxy", "NetworkConditions",
           "Outage", "OutageMode", "ProxyStats", "ProxyThread", "parse_conditions"]
