"""The activation rows a session owes the edge's drafter, computed when they go out.

The server half of the drafter (ActivationSource, cloud_server/moa/activations.py) turns what a
forward verified into one row per cache position. While the server tells the edge to rest
(Verdict.next, cloud_server/decoding/pacing.py) the edge drafts nothing and needs no rows: those
of such a time are computed once a Verdict asks for a draft again, in one call from what the
forwards kept, and never if none does. Computed after every forward they cost a measurable
share of a decoding step (results log, `latency_lazy_rows`), and a paced session at rest is
otherwise exactly server-side speculation. Runs on the model thread; knows nothing of gRPC.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from transformers import DynamicCache

from shared.messages import ActivationFormat, ActivationRows


class ActivationSource(Protocol):
    """The server half of a drafter fed by activations (cloud_server/moa/activations.py)."""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs it reads, captured during the forward; () for none."""

    def __call__(self, cache: DynamicCache, start: int, end: int,
                 hidden: torch.Tensor | None = None) -> np.ndarray:
        """The rows of cache positions [start, end): [end - start, width]; hidden:
        [end - start, L, width], those positions' captured layer outputs, or None."""


class RowKeeper:
    """Every verified cache position's row, computed at the latest when a Verdict takes it."""

    def __init__(self, source: ActivationSource, form: ActivationFormat):
        self.source = source
        self.form = form
        self.paused = False  # the edge is told to rest: Verdicts carry no rows
        self._rows = np.zeros((0, 0), dtype=np.float16)  # [computed positions, width]
        # Verified positions not computed yet: (start, end, their captured layer outputs)
        self._pending: list[tuple[int, int, torch.Tensor | None]] = []
        self._sent = 0  # positions [0, _sent) went out in a Verdict

    def verified(self, start: int, end: int, hidden: torch.Tensor | None) -> None:
        """A forward verified cache positions [start, end); `hidden` [end - start, L, width]:
        their captured layer outputs, when the source reads any."""
        known = self._pending[-1][1] if self._pending else len(self._rows)
        if start != known:
            raise ValueError(f"rows of positions from {known} are due, not from {start}")
        self._pending.append((start, end, hidden))

    def taken(self, cache: DynamicCache, first: int) -> ActivationRows | None:
        """The rows a Verdict carries: from `first` (or from the first position the edge has
        not been sent, if earlier: what a pause held back) to the end of the cache; None while
        paused or when there are none."""
        if self.paused:
            return None
        self._compute(cache)
        first = min(first, self._sent)
        if first >= len(self._rows):
            return None
        self._sent = len(self._rows)
        return ActivationRows(first, self._rows[first:], self.form)

    def _compute(self, cache: DynamicCache) -> None:
        """The pending positions' rows, in one call of the source."""
        if not self._pending:
            return
        start, end = self._pending[0][0], self._pending[-1][1]
        captured = [hidden for _, _, hidden in self._pending if hidden is not None]
        self._pending.clear()
        rows = self.source(cache, start, end, torch.cat(captured) if captured else None)
        self._rows = np.concatenate((self._rows, rows)) if len(self._rows) else rows
