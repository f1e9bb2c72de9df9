"""The forward shapes the static engine captures: sessions x tokens a session x context.

A forward is padded up to the smallest bucket that holds it (vLLM pads verification to its
capture sizes the same way). Tokens a session are a pending token plus a tree of 2^k nodes;
the context a row attends over grows by 4x (a row reads its slot's first `ctx` positions, so a
coarse step costs a few extra KV reads, a fine one more graphs), ending at the slot's length.
"""
from __future__ import annotations

from dataclasses import dataclass

SESSIONS = (1, 2, 4, 8, 16)
FIRST_CONTEXT = 256
CONTEXT_STEP = 4


@dataclass(frozen=True)
class Shape:
    sessions: int
    tokens: int
    context: int


@dataclass(frozen=True)
class Buckets:
    sessions: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]

    @classmethod
    def up_to(cls, most_tree_nodes: int, positions: int, most_sessions: int) -> "Buckets":
        """Buckets for trees of up to `most_tree_nodes` and slots of `positions`."""
        tokens = [1]
        while tokens[-1] < most_tree_nodes + 1:
            tokens.append(2 * tokens[-1] - 1 if tokens[-1] > 1 else 3)
        contexts = [min(FIRST_CONTEXT, positions)]
        while contexts[-1] < positions:
            contexts.append(min(contexts[-1] * CONTEXT_STEP, positions))
        sessions = [s for s in SESSIONS if s < most_sessions] + [min(most_sessions, SESSIONS[-1])]
        return cls(tuple(sorted(set(sessions))), tuple(tokens), tuple(contexts))

    @property
    def all(self) -> list[Shape]:
        return [Shape(s, t, c) for s in self.sessions for t in self.tokens
                for c in self.contexts]

    def sessions_for(self, n: int) -> int:
        """The smallest session bucket for `n` sessions; the largest beyond it (a batch of
        more is cut into forwards of that many)."""
        return next((s for s in self.sessions if s >= n), self.sessions[-1])

    def tokens_for(self, n: int) -> int | None:
        """The smallest token bucket for `n` tokens, None beyond the largest."""
        return next((t for t in self.tokens if t >= n), None)

    def fit(self, sessions: int, tokens: int, context: int) -> Shape | None:
        """The smallest bucket holding a forward of this size, None when none does."""
        s = next((b for b in self.sessions if b >= sessions), None)
        t = self.tokens_for(tokens)
        c = next((b for b in self.contexts if b >= context), None)
        return None if s is None or t is None or c is None else Shape(s, t, c)
