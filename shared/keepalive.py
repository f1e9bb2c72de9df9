"""The keepalive contract between the edge and the server, in one place.

The edge pings every `PING_INTERVAL_MS` and drops a link whose ping goes unanswered for
`PING_TIMEOUT_MS`, so a dead or black-holed link shows within about two seconds (measured: ~1.4 s)
instead of at the round deadline. A gRPC server refuses pings more frequent than it allows with
GOAWAY "too_many_pings", so the server's allowance is derived from the edge's interval here,
never set apart from it.
"""
from __future__ import annotations

PING_INTERVAL_MS = 1000
PING_TIMEOUT_MS = 1000
# Downloads (the tokenizer, the drafter bundle) fill the link with their own data, and a ping's
# answer waits behind it in the link's queue: 1.5 MB queued on 3G's 2 Mbit/s is 6 s, so a 1 s
# timeout drops every download there (measured with netsim). Their channel waits this long.
BULK_PING_TIMEOUT_MS = 30_000
# The server accepts pings twice as often as the edge sends them: timer jitter never trips it.
SERVER_MIN_PING_INTERVAL_MS = PING_INTERVAL_MS // 2

Options = list[tuple[str, int]]


def client_options(ping_timeout_ms: int = PING_TIMEOUT_MS) -> Options:
    return [
        ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", ping_timeout_ms),
        # Without this grpcio 1.85 never times a ping out on a black-holed link (measured with
        # netsim: a 10 s black hole went unnoticed; with it, UNAVAILABLE after ~1.4 s).
        ("grpc.http2.ping_timeout_ms", ping_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> Options:
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
