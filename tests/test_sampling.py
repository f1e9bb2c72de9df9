"""warp forms p the same way everywhere; seeded randomness replays; the race samples from p."""
from __future__ import annotations

import numpy as np
import pytest

from shared.sampling import (RngStream, SamplingParams, race_noise, race_winner, round_rng,
                             sample, warp)

LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                   [0.0, 3.0, 3.0, 1.0, 2.0, -1.0]])  # [2, vocab]


def softmax(x: np.ndarray) -> np.ndarray:
    """probs: [..., vocab] from x: [..., vocab]."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    probs = warp(LOGITS, SamplingParams(temperature=temperature))
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, softmax(LOGITS / temperature), rtol=1e-12)


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    probs = warp(LOGITS, SamplingParams())
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    assert probs.tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]]


def test_top_k_keeps_exactly_k_and_renormalises():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).sum(-1).tolist() == [2, 2]
    np.testing.assert_allclose(probs[0, :2], softmax(LOGITS[0, :2]), rtol=1e-12)
    assert probs[1].nonzero()[0].tolist() == [1, 2]  # the tie at the top: both kept
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-12)


def test_top_k_tie_at_the_boundary_keeps_the_lower_index():
    probs = warp(LOGITS[1], SamplingParams(temperature=1.0, top_k=1))
    assert probs.tolist() == [0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("top_p, kept", [
    (0.05, [0]),  # the most likely token always survives
    (0.49, [0]),  # 0.5 already reaches 0.49
    (0.51, [0, 1]),
    (0.79, [0, 1]),  # 0.5 + 0.3 reaches 0.79: the third token is not needed
    (0.81, [0, 1, 2]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    base = np.array([0.5, 0.3, 0.15, 0.05])  # [vocab]
    probs = warp(np.log(base), SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.nonzero()[0].tolist() == kept
    np.testing.assert_allclose(probs[kept], base[kept] / base[kept].sum(), rtol=1e-12)


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # top-k 3 of [.5, .3, .15, .05] renormalises to [.526, .316, .158]; top-p .8 needs two.
    base = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = warp(base, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert probs.nonzero()[0].tolist() == [0, 1]


def test_rows_sum_to_one_on_random_logits():
    logits = np.random.default_rng(0).normal(size=(64, 50)) * 3  # [64, vocab]
    for params in [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                   SamplingParams(temperature=1.0, top_p=0.6),
                   SamplingParams(temperature=0.9, top_k=10, top_p=0.9)]:
        probs = warp(logits, params)
        assert probs.shape == logits.shape and (probs >= 0).all()
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed"),
])
def test_invalid_params_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_round_rng_replays_and_streams_differ():
    def draw(stream: RngStream, counter: int) -> list[float]:
        return round_rng(7, stream, counter).random(4).tolist()

    assert draw(RngStream.VERIFY, 3) == draw(RngStream.VERIFY, 3)
    assert draw(RngStream.VERIFY, 3) != draw(RngStream.VERIFY, 4)
    assert draw(RngStream.VERIFY, 3) != draw(RngStream.DRAFT, 3)
    assert round_rng(None, RngStream.VERIFY, 3).random() != round_rng(
        None, RngStream.VERIFY, 3).random()


def test_race_noise_is_a_pure_function_of_seed_and_position():
    noise = race_noise(11, 5, 8)  # [vocab]
    assert noise.shape == (8,) and (noise > 0).all()
    assert race_noise(11, 5, 8).tolist() == noise.tolist()
    assert race_noise(11, 6, 8).tolist() != noise.tolist()
    assert race_noise(12, 5, 8).tolist() != noise.tolist()
    # pinned: a change here breaks replay of seeded ERSD sessions across versions
    assert race_noise(0, 0, 3).tolist() == pytest.approx([1.3244698963, 1.572260073,
                                                          0.3288139366], abs=1e-9)


def test_sample_and_race_winner_follow_p():
    probs = np.array([0.5, 0.0, 0.3, 0.2])  # [vocab]
    rng = np.random.default_rng(1)
    draws = np.bincount([sample(probs, rng) for _ in range(20_000)], minlength=4) / 20_000
    wins = np.bincount([race_winner(probs, race_noise(2, t, 4)) for t in range(20_000)],
                       minlength=4) / 20_000
    # E[TV] <= 0.5 * sqrt(4 / 20k) = 0.007; McDiarmid adds sqrt(ln(1e6) / 40k) = 0.019 for a
    # false alarm below 1e-6 (see tests/test_acceptance_sampling.py).
    for freq in (draws, wins):
        assert freq[1] == 0
        assert 0.5 * np.abs(freq - probs).sum() < 0.026


def test_race_winner_on_one_hot_is_the_argmax():
    one_hot = np.array([0.0, 0.0, 1.0, 0.0])
    assert all(race_winner(one_hot, race_noise(3, t, 4)) == 2 for t in range(50))


def test_a_subnormal_p_never_wins_the_race_and_warns_of_nothing():
    """Found by the reliability benchmark's fuzzer: noise / 1e-310 overflows to inf, which is
    the right arrival (never), but numpy warned on the server's stderr."""
    import warnings

    probs = np.array([1e-310, 0.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert race_winner(probs, np.array([1.0, 1.0, 1.0])) == 2
