"""Race-aware drafting (ERSD): under exponential-race the trained drafters rank a node's
children by how likely the session's race picks each, from log q and the race's noise weighed
by a fit on the committed text; the text stays the one plain decoding samples with the same
seed, whatever is drafted."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_server.decoding.server_decoding import decode_in_process
from edge_client.drafters.lookup_merge import LookupMerge
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.race_aware import RaceAware
from edge_client.drafters.trained import trained_drafter
from edge_client.drafters.tree_search import TreeSearch
from shared.acceptance import AcceptanceMode
from shared.drafter_bundle import Precision
from shared.drafting.base import DrafterName
from shared.drafting.race import Race, RaceRanker
from shared.messages import OpenRequest
from shared.sampling import SamplingParams, race_noise, race_winner

PROMPT = (1, 46, 47, 48, 49)
VOCAB = 300


def test_a_fresh_ranker_ranks_by_log_q():
    rng = np.random.default_rng(0)
    ids = rng.choice(VOCAB, size=8, replace=False)
    logprobs = np.log(rng.dirichlet(np.ones(8)))
    ranker = RaceRanker(Race(seed=11, temperature=0.7), VOCAB)
    ranker.start([1, 2, 3])
    scores = ranker.scores(logprobs, ids, ())
    assert np.allclose(scores, logprobs - np.logaddexp.reduce(logprobs))


def _session(ranker: RaceRanker, rng: np.random.Generator, rounds: int, coupled: bool) -> None:
    """Rounds of one drafted row each, whose winner is the race on a p_T close to q^1.5
    (coupled) or a draw from it that ignores the race noise."""
    context = [1, 2, 3]
    for _ in range(rounds):
        ranker.start(context)
        ids = rng.choice(VOCAB, size=8, replace=False)
        logprobs = np.log(rng.dirichlet(np.full(8, 0.5)))
        ranker.scores(logprobs, ids, ())
        target = np.zeros(VOCAB)
        target[ids] = np.exp(1.5 * logprobs + rng.normal(0, 0.5, 8))
        winner = (race_winner(target, race_noise(ranker.race.seed, len(context), VOCAB))
                  if coupled else rng.choice(VOCAB, p=target / target.sum()))
        context.append(int(winner))
    ranker.start(context)


def test_the_fit_weighs_the_race_noise_by_what_it_says_of_the_winner():
    rng = np.random.default_rng(1)
    coupled, blind = (RaceRanker(Race(seed=5, temperature=0.7), VOCAB) for _ in range(2))
    _session(coupled, rng, 300, coupled=True)
    _session(blind, rng, 300, coupled=False)
    assert coupled.fitted == blind.fitted == 300
    assert coupled.weights[1] > 0.5 and coupled.weights[0] > 1.0  # both log q and the noise
    assert abs(blind.weights[1]) < 0.25 and blind.weights[0] > 1.0  # log q alone, sharpened


def test_the_fit_carries_over_at_the_same_temperature():
    ranker = RaceRanker(Race(seed=5, temperature=0.7), VOCAB)
    _session(ranker, np.random.default_rng(2), 50, coupled=True)
    fitted = ranker.weights.copy()
    assert ranker.follow(Race(seed=6, temperature=0.7)) is ranker
    assert np.array_equal(ranker.weights, fitted) and ranker.race.seed == 6
    fresh = ranker.follow(Race(seed=6, temperature=1.0))
    assert fresh.fitted == 0 and np.array_equal(fresh.weights, [1.0, 0.0])


def test_a_rows_winner_outside_its_top_k_teaches_nothing():
    ranker = RaceRanker(Race(seed=5, temperature=0.7), VOCAB)
    ranker.start([1, 2, 3])
    ranker.scores(np.log(np.full(4, 0.25)), np.array([10, 11, 12, 13]), ())
    ranker.start([1, 2, 3, 99])
    assert ranker.fitted == 0


def test_the_tree_follows_the_fitted_race(tiny_target, tiny_bundle):
    """A fresh ranker drafts the log-q tree; weighed as the race on q alone (log q / T + G),
    the tree's first node is that race's winner."""
    graphs = MoaGraphs(tiny_bundle, Precision.INT8)
    model = MoaDrafter(graphs, TreeSearch(max_depth=4))
    drafter = RaceAware(model, graphs.vocab)
    drafter.reset(PROMPT)
    context = list(PROMPT) + [30]
    drafter.add_activations(0, np.zeros((len(PROMPT), graphs.width), dtype=np.float32))
    logprobs, ids = model._sync(context)
    drafter.follow_race(Race(5, 0.8))
    assert drafter.propose(context, 32).tokens[0] == ids[0]
    assert drafter.ranker is not None
    drafter.ranker.weights = np.array([1 / 0.8, 1.0])
    warped = np.zeros(tiny_target.model.config.vocab_size)
    warped[ids] = np.exp(logprobs / 0.8)
    winner = race_winner(warped, race_noise(5, len(context), len(warped)))
    assert drafter.propose(context, 32).tokens[0] == winner
    drafter.follow_race(None)
    assert drafter.propose(context, 32).tokens[0] == ids[0]  # by log q again


def test_a_race_only_under_its_rule():
    sampled = SamplingParams(temperature=0.7)
    assert Race.of(AcceptanceMode.EXPONENTIAL_RACE, 3, sampled) == Race(3, 0.7)
    assert Race.of(AcceptanceMode.TOPK_DRAFTS, 3, sampled) is None
    assert Race.of(AcceptanceMode.EXPONENTIAL_RACE, 3, SamplingParams()) is None


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_race_aware_drafts_leave_the_text_as_it_was(tiny_target, tiny_bundle, tiny_drafter_dir,
                                                    temperature):
    from cloud_server.moa.activations import ServerActivations

    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    request = OpenRequest(prompt_ids=PROMPT, max_new_tokens=24,
                          sampling=SamplingParams(temperature=temperature, seed=9),
                          acceptance=AcceptanceMode.EXPONENTIAL_RACE)
    plain = decode_in_process(tiny_target, request, None, 0)
    graphs = MoaGraphs(tiny_bundle)
    aware = RaceAware(MoaDrafter(graphs), graphs.vocab)
    texts = []
    for drafter in (LookupMerge(aware), trained_drafter(tiny_bundle, DrafterName.MOA)):
        run = decode_in_process(tiny_target, request, drafter, 16, server)
        texts.append([t for v in run.verdicts for t in v.tokens])
    assert aware.ranker is not None  # the session's race reached the drafter
    assert texts[0] == texts[1] == [t for v in plain.verdicts for t in v.tokens]
