"""Race-aware drafting (ERSD, Kobus and Gunduz 2025, arXiv 2504.15475, section 3).

Under acceptance exponential-race the token at each position is the winner of a race run on the
target's warped p with noise keyed by the session's seed and the position
(shared/sampling.py race_noise), and the edge knows the seed from Opened. A drafter whose q is
close to p names that winner by running the same race on its own q, warped by the same
temperature: the token with the largest key log q(x) / T + G(x), G = -log E (Gumbel-max, as
`race_winner`). Its tree then ranks a node's children by their key behind the winner's (0 for
the winner), so the path it expands deepest is the one the target's race most likely takes;
ranked by log q alone it would expand the likeliest tokens, which a race at T > 0 often passes
over. The text does not change: it is a function of (seed, prompt) whatever is drafted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.sampling import SamplingParams, race_noise


@dataclass(frozen=True)
class Race:
    """The session's race: its seed and the temperature p is warped by."""

    seed: int
    temperature: float

    @classmethod
    def of(cls, acceptance: AcceptanceMode | None, seed: int,
           sampling: SamplingParams) -> "Race | None":
        """The race a session runs, or None when it verifies with another rule."""
        if acceptance is not AcceptanceMode.EXPONENTIAL_RACE or sampling.temperature <= 0:
            return None
        return cls(seed, sampling.temperature)


class RaceKeys:
    """A race's keys for drafted tokens; each position's noise is drawn once (the vocabulary's
    stream costs about a millisecond) and kept while drafting still reaches it."""

    def __init__(self, race: Race, vocab: int) -> None:
        self.race, self.vocab = race, vocab
        self._noise: dict[int, np.ndarray] = {}

    def forget_before(self, position: int) -> None:
        """Drops the noise of positions below `position` (committed: never drafted again)."""
        self._noise = {p: n for p, n in self._noise.items() if p >= position}

    def behind_winner(self, logprobs: np.ndarray, ids: np.ndarray,
                      position: int) -> np.ndarray:
        """log q [k] of candidate tokens `ids` [k] at `position` -> each one's race key minus
        the largest (0 for the winner of the race on q among them): [k]."""
        if position not in self._noise:
            self._noise[position] = race_noise(self.race.seed, position, self.vocab)
        keys = logprobs / self.race.temperature - np.log(self._noise[position][ids])
        return keys - keys.max()
