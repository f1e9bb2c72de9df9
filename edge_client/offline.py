"""What the edge does while the link is down: draft alone, pace reconnects, reconcile afterwards.

Offline tokens are the best path of prompt lookup where the text has a continuation to copy,
else of the drafter, repeating no 4-gram of the offline text (LOG offline_text); unverified.
When the link is back they are sent as a chain; the edge keeps what the target agrees with and
drops the rest (docs/architecture.md, Resume and offline mode), so the final text is exactly
the target's. Knows the drafters, not gRPC.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from shared.tree import ROOT, DraftTree

OFFLINE_DRAFT_NODES = 16  # tree size asked of the drafter per offline step; one path is used
NO_REPEAT = 4  # offline text repeats no n-gram of its own this long


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


class Proposes(Protocol):
    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree: ...


def draft_offline(drafters: Sequence[Proposes], context: Sequence[int], room: int,
                  offline_from: int | None = None) -> list[int]:
    """Up to `room` tokens continuing `context`: step after step, the first of `drafters`
    whose best path, taken so that it repeats no NO_REPEAT-gram of the offline text
    (context[offline_from:], none by default), is not empty; fewer when none has more."""
    start = len(context) if offline_from is None else offline_from
    text = list(context)
    seen = {tuple(text[i - NO_REPEAT + 1:i + 1])
            for i in range(max(start, NO_REPEAT - 1), len(text))}
    while len(text) - len(context) < room:
        path = next((p for d in drafters if (p := fresh_path(
            d.propose(text, OFFLINE_DRAFT_NODES), text[-(NO_REPEAT - 1):], seen))), [])
        if not path:
            break
        text += path[: room - (len(text) - len(context))]
    return text[len(context):]


def fresh_path(tree: DraftTree, tail: Sequence[int], seen: set[tuple[int, ...]]) -> list[int]:
    """The path through `tree` that takes each node's best child whose token completes no
    n-gram in `seen` (n = NO_REPEAT; `tail`: the n - 1 tokens before the tree), adding the
    n-grams it completes to `seen`. HF generate's no_repeat_ngram_size, over a drafter's
    ranked children: a drafter left alone without the server's rows loops (LOG
    offline_text), and the target's own text seldom repeats a 4-gram."""
    path: list[int] = []
    text, node = list(tail), ROOT
    while True:
        for child in tree.children(node):
            gram = (*text[-(NO_REPEAT - 1):], tree.tokens[child])
            if len(gram) < NO_REPEAT or gram not in seen:
                break
        else:
            return path
        if len(gram) == NO_REPEAT:
            seen.add(gram)
        node = child
        path.append(tree.tokens[child])
        text.append(tree.tokens[child])


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
