"""The server's table of sessions: who owns each one, and how long an orphan is kept.

A session belongs to at most one stream at a time, its owner. When a stream breaks, its session
stays, detached, for `session_idle_timeout_s` after its last activity, so the edge can resume it
on a new stream (docs/architecture.md, Resume and offline mode); a resume takes a session over even from a stream that looks
alive to the server (a black-holed link is noticed by the edge first). Knows nothing of gRPC
or of the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from cloud_server.decoding.session import Session
from shared.errors import Forbidden, Overloaded
from shared.messages import Limits


@dataclass
class _Entry:
    session: Session
    owner: object | None  # None: detached, waiting for a resume
    active_at: float
    kv_bytes: int = 0  # the KV cache it may grow to (Session.kv_bytes)
    caller: str | None = None  # who opened it (security.caller); only they may resume it


class SessionTable:
    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic,
                 kv_budget_bytes: int = 0):
        """`kv_budget_bytes`: the KV cache all sessions may hold together, counted at the most
        each can grow to; 0: no budget, the session count alone limits."""
        self.limits = limits
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self.kv_budget_bytes = kv_budget_bytes

    @property
    def kv_bytes(self) -> int:
        return sum(e.kv_bytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def reserve(self) -> None:
        """Raises Overloaded when no new session fits, after dropping expired orphans and, at
        the limit, orphans whose generation finished (their edge most likely has all of it: a
        stream often ends by a cancel the server sees before the half-close; a late resume of
        one is rebuilt from its history)."""
        self.evict_expired()
        if len(self._entries) >= self.limits.max_sessions:
            self._evict_finished()
        if len(self._entries) >= self.limits.max_sessions:
            raise Overloaded(f"server is at its limit of {self.limits.max_sessions} sessions; "
                             "retry in a few seconds")

    def add(self, session: Session, owner: object, kv_bytes: int = 0,
            caller: str | None = None) -> None:
        """Raises Overloaded when the session's KV cache would pass the budget, after dropping
        expired and finished orphans; sessions already admitted are never squeezed."""
        if self.kv_budget_bytes and self.kv_bytes + kv_bytes > self.kv_budget_bytes:
            self.evict_expired()
            self._evict_finished()
            if self.kv_bytes + kv_bytes > self.kv_budget_bytes:
                free = max(0, self.kv_budget_bytes - self.kv_bytes)
                raise Overloaded(f"the session needs {kv_bytes / 2**20:.0f} MiB of KV cache "
                                 f"and {free / 2**20:.0f} MiB of the server's "
                                 f"{self.kv_budget_bytes / 2**20:.0f} MiB are free; retry "
                                 "when a session ends, or ask for fewer tokens")
        self._entries[session.id] = _Entry(session, owner, self._clock(), kv_bytes, caller)

    def take_over(self, session_id: str, owner: object, caller: str | None = None
                  ) -> Session | None:
        """The session, now owned by `owner`; None when the server no longer holds it. Raises
        Forbidden when `caller` is not who opened it."""
        self.evict_expired()
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.caller != caller:
            raise Forbidden(f"session {session_id} was opened by another client")
        entry.owner, entry.active_at = owner, self._clock()
        entry.session.epoch += 1
        return entry.session

    def owns(self, session: Session, owner: object) -> bool:
        entry = self._entries.get(session.id)
        if entry is None or entry.owner is not owner:
            return False
        entry.active_at = self._clock()
        return True

    def detach(self, session: Session, owner: object) -> None:
        """The owner's stream broke: keep the session for a resume."""
        entry = self._entries.get(session.id)
        if entry is not None and entry.owner is owner:
            entry.owner = None

    def orphan(self, session_id: str) -> Session | None:
        """The session if it is detached, held for a resume; None while a stream owns it or
        once it is gone. For watchers (tests) of the server noticing a broken stream."""
        entry = self._entries.get(session_id)
        return entry.session if entry is not None and entry.owner is None else None

    def release(self, session: Session, owner: object) -> None:
        """The owner is done with the session: drop it (unless another stream took it over)."""
        entry = self._entries.get(session.id)
        if entry is not None and entry.owner is owner:
            del self._entries[session.id]

    def _evict_finished(self) -> None:
        for sid in [sid for sid, e in self._entries.items()
                    if e.owner is None and e.session.finished]:
            del self._entries[sid]

    def evict_expired(self) -> int:
        """Drops the orphans idle past the timeout (with their KV caches); returns how many."""
        deadline = self._clock() - self.limits.session_idle_timeout_s
        expired = [sid for sid, e in self._entries.items()
                   if e.owner is None and e.active_at < deadline]
        for sid in expired:
            del self._entries[sid]
        return len(expired)
