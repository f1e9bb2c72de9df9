"""Prometheus metrics of a running server (`cloud-server --metrics-port`).

Each service owns its registry, so several servers in one process (tests) keep apart. What a
forward did is read off the Verdict it produced, at the one place every message leaves.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server,
)

from shared.messages import ServerMessage, Verdict

MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
MAX_DEPTH_LABEL = 16  # deeper accepted paths count in the last bucket


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ...
        self.sessions_open = Gauge("splitdec_sessions_open", "sessions held (streaming or "
                                   "waiting for a resume)", registry=r)
        self.sessions_opened = Counter("splitdec_sessions_opened", "sessions opened, by how",
                                       ["how"], registry=r)
        self.refused = Counter("splitdec_requests_refused", "calls refused, by gRPC status",
                               ["code"], registry=r)
        self.forwards = Counter("splitdec_forwards", "session forwards (prefills, tree "
                                "verifications, decoding steps), batched or not", registry=r)
        self.model_forwards = Counter("splitdec_model_forwards", "forward passes of the "
                                      "target (one may serve several sessions)", registry=r)
        self.batch_sessions = Histogram("splitdec_batch_sessions", "sessions per forward pass",
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.batch_tokens = Histogram("splitdec_batch_tokens", "new tokens per forward pass",
                                      buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024),
                                      registry=r)
        self.forward_ms = Histogram("splitdec_forward_ms", "time of one forward pass (ms)",
                                    buckets=MS_BUCKETS, registry=r)
        self.tokens = Counter("splitdec_tokens_generated", "tokens committed", registry=r)
        self.accepted = Histogram("splitdec_accepted_draft_tokens", "draft tokens accepted "
                                  "per forward", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
                                  registry=r)
        depth = Counter("splitdec_accepted_at_depth", "forwards whose accepted path reached "
                        "this depth", ["depth"], registry=r)
        self.verify_ms = Histogram("splitdec_verify_ms", "time on the model per forward (ms)",
                                   buckets=MS_BUCKETS, registry=r)
        self.queue_ms = Histogram("splitdec_queue_ms", "time waiting for the model (ms)",
                                  buckets=MS_BUCKETS, registry=r)
        sizes = Counter("splitdec_bytes", "message bytes on Decode and Generate streams",
                        ["direction"], registry=r)
        # Labelled children looked up once: every message and forward counts here, on the event
        # loop that shares a core with the forwards
        self._bytes_in, self._bytes_out = sizes.labels("in"), sizes.labels("out")
        self._accepted_depth = [depth.labels(str(d)) for d in range(1, MAX_DEPTH_LABEL + 1)]

    def received(self, size: int) -> None:
        self._bytes_in.inc(size)

    def sent(self, msg: ServerMessage, size: int) -> None:
        self._bytes_out.inc(size)
        if not isinstance(msg, Verdict) or msg.verify_ms <= 0:  # a catch-up is no forward
            return
        self.forwards.inc()
        self.tokens.inc(len(msg.tokens))
        self.accepted.observe(len(msg.accepted_nodes))
        for reached in self._accepted_depth[:len(msg.accepted_nodes)]:
            reached.inc()
        self.verify_ms.observe(msg.verify_ms)
        self.queue_ms.observe(msg.queue_ms)

    def forwarded(self, sessions: int, tokens: int, seconds: float) -> None:
        """One forward pass of the target ran `sessions` sessions' `tokens` new tokens."""
        self.model_forwards.inc()
        self.batch_sessions.observe(sessions)
        self.batch_tokens.observe(tokens)
        self.forward_ms.observe(1000 * seconds)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP from a daemon thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
