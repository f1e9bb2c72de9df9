"""What the edge does while the link is down: draft alone, pace reconnects, reconcile afterwards.

Offline tokens are the drafter's best path, unverified. When the link is back they are sent as a
chain; the edge keeps what the target agrees with and drops the rest (docs/architecture.md, Resume and offline mode), so the
final text is exactly the target's. Knows the drafter, not gRPC.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Sequence

from shared.drafting.base import Drafter

OFFLINE_DRAFT_NODES = 16  # tree size asked of the drafter per offline step; only its best path is used


class OfflinePolicy(enum.Enum):
    DRAFT = "draft"  # draft offline up to the limit, then wait; fail if the server never returns
    WAIT = "wait"  # draft nothing; wait for the server
    KEEP = "keep"  # as DRAFT, and if the server never returns, keep the unverified text


@dataclass(frozen=True)
class LinkPolicy:
    offline: OfflinePolicy = OfflinePolicy.DRAFT
    offline_limit: int = 64  # unverified tokens at most, then wait
    reconnect_timeout_s: float = 120.0  # give up after this long without the server; 0: never try
    # Pauses between resume attempts; each attempt itself waits up to the link's resume timeout
    # for the channel to reconnect, so these only spread out edges that retry together.
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 1.0
    pipeline: bool = True  # draft the next tree while a round is in flight


class Backoff:
    """Exponential backoff with jitter: the n-th wait is uniform in [cap/2, cap] with cap =
    min(max, initial * 2**n), so edges that lost the same server do not all redial at once."""

    def __init__(self, policy: LinkPolicy, rng: random.Random | None = None):
        self._policy = policy
        self._rng = rng or random.Random()
        self._attempt = 0

    def next_wait_s(self) -> float:
        cap = min(self._policy.backoff_max_s, self._policy.backoff_initial_s * 2 ** self._attempt)
        self._attempt += 1
        return self._rng.uniform(0.5 * cap, cap)


def draft_offline(drafter: Drafter, context: Sequence[int], room: int) -> list[int]:
    """Up to `room` tokens continuing `context`, the drafter's best path step after step; fewer
    when the drafter has nothing more to offer."""
    drafted: list[int] = []
    while len(drafted) < room:
        path = drafter.propose([*context, *drafted], OFFLINE_DRAFT_NODES).best_path()
        if not path:
            break
        drafted += path[: room - len(drafted)]
    return drafted


def reconcile(offline: list[int], committed: Sequence[int]) -> tuple[list[int], int]:
    """Matches newly committed tokens against the unverified ones that continued the same text.

    Returns the unverified tokens still pending (those past the committed ones, when all of
    those agreed) and how many were rewound (from the first disagreement on, all of them)."""
    for i, token in enumerate(committed):
        if i == len(offline):
            return [], 0
        if offline[i] != token:
            return [], len(offline) - i
    return offline[len(committed):], 0
