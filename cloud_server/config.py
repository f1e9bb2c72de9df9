"""What a cloud-server is told to serve: its limits, pacing, drafter and memory settings.

Plain settings, read by `server.build_service` and the service; loads nothing, so the CLI can
build one without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cloud_server.decoding.batching import DEFAULT_MAX_TOKENS
from shared.drafting.base import DrafterName
from shared.messages import Limits, Pace


@dataclass(frozen=True)
class PacingPolicy:
    """The server's side of pacing: what a session gets when its Open leaves pace or lead
    unset, the most lead it may ask for, the drafter the server runs for its own candidates
    (None: a forward without client candidates is a plain decoding step), and whether `auto`
    waits longer for drafts while other sessions have work queued."""

    pace: Pace = Pace.LOCKSTEP
    # Covers the client's acknowledgements queued behind a prompt's rows on a slow link
    # (results log, `pacing_notes`); a dead link costs at most this many tokens of forwards,
    # and they are kept for a resume.
    lead: int = 128
    max_lead: int = 256
    # Token Recycling: it drafts best of the server's own drafters (results log, `recycle_tau`)
    drafter: DrafterName | None = DrafterName.RECYCLE
    load_wait: bool = True

    def resolve(self, pace: Pace | None, lead: int) -> tuple[Pace, int]:
        """The session's pace and lead, from what its Open asked (None, 0: the defaults)."""
        return pace or self.pace, min(lead or self.lead, self.max_lead)


@dataclass(frozen=True)
class ServerConfig:
    """`drafter_dir`: the trained drafter to serve (None: none). `kv_budget_bytes`: the KV cache
    all sessions may hold together (0: the session count alone limits, SessionTable).
    `batch_tokens`: the most new tokens one batched forward runs (0: one session a forward).
    `graphs_at_start`: the engine gets ready for batches of every size it may run before the
    server serves (Engine.prepare), instead of when a batch first needs it."""

    limits: Limits = field(default_factory=Limits)
    drafter_dir: Path | None = None
    pacing: PacingPolicy = field(default_factory=PacingPolicy)
    kv_budget_bytes: int = 0
    batch_tokens: int = DEFAULT_MAX_TOKENS
    graphs_at_start: bool = False
