"""What a cloud-server is told to serve: its limits, pacing, drafter and memory settings.

Plain settings, read by `server.build_service` and the service; loads nothing, so the CLI can
build one without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cloud_server.decoding.batching import DEFAULT_MAX_TOKENS
from cloud_server.decoding.pacing import PacingPolicy
from shared.messages import Limits


@dataclass(frozen=True)
class ServerConfig:
    """`drafter_dir`: the trained drafter to serve (None: none). `kv_budget_bytes`: the KV cache
    all sessions may hold together (0: the session count alone limits, SessionTable).
    `batch_tokens`: the most new tokens one batched forward runs (0: one session a forward)."""

    limits: Limits = field(default_factory=Limits)
    drafter_dir: Path | None = None
    pacing: PacingPolicy = field(default_factory=PacingPolicy)
    kv_budget_bytes: int = 0
    batch_tokens: int = DEFAULT_MAX_TOKENS
