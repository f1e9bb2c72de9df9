"""Race-aware drafting (ERSD, Kobus and Gunduz 2025, arXiv 2504.15475, section 3).

Under acceptance exponential-race the token at each position is the winner of a race run on the
target's warped p with noise keyed by the session's seed and the position
(shared/sampling.py race_noise): the token with the largest log p_T(x) + G(x), G = -log E
(Gumbel-max, as `race_winner`), and the edge knows the seed from Opened. A drafter whose q were
p_T would name that winner exactly by running the same race on q. A small drafter's q is not
p_T: run as it is, its race picks the wrong winner more often than its top token is right
(results log, `moa_tau`).

So the ranker asks how much the race noise and log q each tell: it models the target's winner
among a node's top-k candidates as a conditional logit, P(x) = softmax(a log q(x) + b G(x)),
and fits (a, b) online, by Newton's method on a window of positions the session committed
(each one's winner is known once committed; the drafter's row for it is kept when the drafted
path led there). (a, b) starts at (1, 0), ranking by log q alone as without the race, and
moves only as far as the evidence carries it; b > 0 is what the race adds. A node's children
are ranked, and the tree's paths scored, by log P. The text does not change: it is a function
of (seed, prompt) whatever is drafted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.sampling import SamplingParams, race_noise

START = np.array([1.0, 0.0])  # (a, b): log q alone, the ranking without the race
PRIOR = 4.0  # L2 pull towards START, in samples' worth: a few rounds outweigh it
WINDOW = 512  # committed positions the fit keeps
NEWTON_STEPS = 3  # per round, from the previous fit


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


class RaceRanker:
    """Scores a node's candidate children by log P(the target's race picks it), with (a, b)
    fitted on the positions committed so far.

    One round: `start(context)` learns from what was committed since the previous round's rows,
    then `scores(logprobs, ids, path)` for each node drafted, `path` being the drafted tokens
    from the round's context to that node."""

    def __init__(self, race: Race, vocab: int) -> None:
        self.race, self.vocab = race, vocab
        self.weights = START.copy()  # (a, b)
        self._noise: dict[int, np.ndarray] = {}
        self._samples: deque[tuple[np.ndarray, int]] = deque(maxlen=WINDOW)  # ([k, 2], winner)
        self._base: tuple[int, ...] = ()  # the context the kept rows were drafted from
        self._rows: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def follow(self, race: Race) -> "RaceRanker":
        """The ranker for a new session: what was learnt carries over at the same temperature
        (the drafter and target are the same; only the noise differs)."""
        if race.temperature != self.race.temperature:
            return RaceRanker(race, self.vocab)
        self.race, self._noise, self._base, self._rows = race, {}, (), {}
        return self

    @property
    def fitted(self) -> int:
        """How many committed positions the weights were fitted on."""
        return len(self._samples)

    def start(self, context: Sequence[int]) -> None:
        """A round drafts from `context`: the positions committed since the kept rows become
        samples, the weights are refitted, and the rows and older noise are dropped."""
        base = len(self._base)
        if len(context) > base and tuple(context[:base]) == self._base:
            for depth in range(len(context) - base):
                row = self._rows.get(tuple(context[base:base + depth]))
                if row is None:
                    break
                self._learn(row, context[base + depth], base + depth)
            self._fit()
        self._base, self._rows = tuple(context), {}
        self._noise = {p: n for p, n in self._noise.items() if p >= len(context)}

    def scores(self, logprobs: np.ndarray, ids: np.ndarray,
               path: Sequence[int]) -> np.ndarray:
        """log q [k] of the candidate children `ids` [k] of the node `path` -> log P that the
        target's race picks each, among them: [k]. Keeps the row to learn from."""
        self._rows[tuple(path)] = (logprobs, ids)
        logits = self._features(logprobs, ids, len(self._base) + len(path)) @ self.weights
        return logits - np.logaddexp.reduce(logits)

    def _features(self, logprobs: np.ndarray, ids: np.ndarray, position: int) -> np.ndarray:
        """[k, 2]: log q and the race's Gumbel noise G = -log E at `position`."""
        if position not in self._noise:  # the vocabulary's stream costs about a millisecond
            self._noise[position] = race_noise(self.race.seed, position, self.vocab)
        gumbel = -np.log(self._noise[position][ids])
        return np.stack((logprobs, gumbel), axis=1)

    def _learn(self, row: tuple[np.ndarray, np.ndarray], winner: int, position: int) -> None:
        logprobs, ids = row
        hits = np.flatnonzero(ids == winner)
        if len(hits):  # a winner outside the top-k says nothing about their order
            self._samples.append((self._features(logprobs, ids, position), int(hits[0])))

    def _fit(self) -> None:
        """Newton steps on the penalised conditional-logit log-likelihood (concave)."""
        if not self._samples:
            return
        features = np.stack([f for f, _ in self._samples])  # [n, k, 2]
        winners = np.array([w for _, w in self._samples])  # [n]
        chosen = features[np.arange(len(winners)), winners]  # [n, 2]
        weights = self.weights
        for _ in range(NEWTON_STEPS):
            logits = features @ weights  # [n, k]
            prob = np.exp(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True))
            mean = np.einsum("nk,nkf->nf", prob, features)  # [n, 2]
            centred = features - mean[:, None]  # [n, k, 2]
            grad = (chosen - mean).sum(0) - PRIOR * (weights - START)
            hessian = np.einsum("nk,nkf,nkg->fg", prob, centred, centred) + PRIOR * np.eye(2)
            weights = weights + np.linalg.solve(hessian, grad)
        self.weights = weights
