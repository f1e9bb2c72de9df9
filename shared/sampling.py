"""Sampling parameters, the warp from logits to probabilities, and seeded randomness.

Edge and server both turn logits into p (or q) with `warp`, so a token's probability is the same
function of the logits on both sides (docs/architecture.md, Verification). Knows nothing of trees, acceptance rules
or models; numpy only, because the edge client has no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from numbers import Integral

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. temperature 0 is greedy; top_k 0 and top_p 1 switch those off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: fresh entropy, the session is not reproducible

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, Integral) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 switches it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 switches it off), got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, Integral) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """probs: [..., vocab] float64 from logits: [..., vocab]; temperature, then top-k, then top-p.

    The order is Hugging Face's logits-warper order. Greedy (temperature 0) gives the one-hot of
    the argmax (lowest index on ties), the limit of softmax(logits / T) as T -> 0, so every
    sampling rule fed a greedy p reduces to greedy acceptance.
    """
    logits = np.asarray(logits, dtype=np.float64)  # [..., vocab]
    if params.greedy:
        return _one_hot_argmax(logits)
    scaled = logits / params.temperature  # [..., vocab]
    if 0 < params.top_k < scaled.shape[-1]:
        scaled = _keep_top_k(scaled, params.top_k)
    probs = _softmax(scaled)  # [..., vocab]
    if params.top_p < 1:
        probs = _keep_nucleus(probs, params.top_p)
    return probs


def _one_hot_argmax(logits: np.ndarray) -> np.ndarray:
    """one_hot: [..., vocab] from logits: [..., vocab]."""
    one_hot = np.zeros_like(logits)  # [..., vocab]
    np.put_along_axis(one_hot, logits.argmax(-1)[..., None], 1.0, axis=-1)
    return one_hot


def _softmax(scaled: np.ndarray) -> np.ndarray:
    """probs: [..., vocab] from scaled logits: [..., vocab] (-inf allowed, not everywhere)."""
    weights = np.exp(scaled - scaled.max(-1, keepdims=True))  # [..., vocab]
    return weights / weights.sum(-1, keepdims=True)


def _keep_top_k(scaled: np.ndarray, k: int) -> np.ndarray:
    """scaled: [..., vocab] with all but the k largest set to -inf (lower index wins ties)."""
    dropped = np.argsort(-scaled, axis=-1, kind="stable")[..., k:]  # [..., vocab - k]
    kept = scaled.copy()  # [..., vocab]
    np.put_along_axis(kept, dropped, -np.inf, axis=-1)
    return kept


def _keep_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """probs: [..., vocab] restricted to the smallest most-likely set with mass >= top_p.

    A token is kept when the mass of the tokens ranked above it is still below top_p, so the
    most likely token is always kept.
    """
    order = np.argsort(-probs, axis=-1, kind="stable")  # [..., vocab]
    ranked = np.take_along_axis(probs, order, axis=-1)  # [..., vocab], descending
    mass_through = np.cumsum(ranked, axis=-1)  # [..., vocab]
    mass_above = np.concatenate(  # [..., vocab]
        [np.zeros_like(ranked[..., :1]), mass_through[..., :-1]], axis=-1)
    keep = np.empty(probs.shape, dtype=bool)  # [..., vocab]
    np.put_along_axis(keep, order, mass_above < top_p, axis=-1)
    kept = np.where(keep, probs, 0.0)  # [..., vocab]
    return kept / kept.sum(-1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token drawn from probs: [vocab] (need not be normalised); zero-probability tokens
    are never drawn."""
    cdf = np.cumsum(probs)  # [vocab]
    # Dividing by the last entry makes the top of the cdf exactly 1.0 > any draw in [0, 1).
    return int(np.searchsorted(cdf / cdf[-1], rng.random(), side="right"))


class RngStream(IntEnum):
    """Independent random streams derived from one session seed.

    Drafting and verifying must not share a stream: the losslessness proofs assume the drafts
    are independent of the server's acceptance coins.
    """

    VERIFY = 1  # server: acceptance coins and residual draws
    DRAFT = 2  # edge: drawing sampled drafts
    RACE = 3  # ERSD: the race noise both sides share, keyed by absolute position


def round_rng(seed: int | None, stream: RngStream, counter: int) -> np.random.Generator:
    """A generator determined by (seed, stream, counter), e.g. counter = the round number, so a
    seeded session replays exactly; fresh entropy when seed is None."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(int(stream), counter)))


def race_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """E: [vocab] i.i.d. Exp(1), a function of (seed, absolute position) only.

    Built from the PCG64 bit stream, which numpy keeps stable across versions, rather than from
    Generator.standard_exponential, whose algorithm may change (NEP 19): edge and server may run
    different numpy versions and must see the same race.
    """
    bits = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(int(RngStream.RACE), position)))
    raw = bits.random_raw(vocab)  # [vocab] uint64
    uniform = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # [vocab] in (0, 1)
    return -np.log(uniform)


def race_winner(probs: np.ndarray, noise: np.ndarray) -> int:
    """The token whose exponential clock rings first: argmin_v E_v / p(v), probs, noise: [vocab].

    E_v / p(v) ~ Exp(rate p(v)), and the first of independent exponential clocks is v with
    probability rate_v / sum(rates), so the winner is an exact sample from p (the exponential
    race, equivalently Gumbel-max with G_v = -log E_v). probs need not be normalised.
    """
    probs = np.asarray(probs, dtype=np.float64)  # [vocab]
    arrival = np.full(probs.shape, np.inf)  # [vocab]; a token with p(v) = 0 never arrives
    with np.errstate(over="ignore"):  # a subnormal p(v) arrives at inf: never, as it should
        np.divide(noise, probs, out=arrival, where=probs > 0)
    return int(np.argmin(arrival))
