"""Race-aware drafting (ERSD): under exponential-race the trained drafters rank a node's
children by their key in the session's race run on q, so the winner of that race leads; the
text stays the one plain decoding samples with the same seed, whatever is drafted."""
from __future__ import annotations

import numpy as np
import pytest

from cloud_server.server_decoding import decode_in_process
from edge_client.drafters.moa import MoaDrafter
from shared.acceptance import AcceptanceMode
from shared.drafter_bundle import Precision
from shared.drafting.race import Race, RaceKeys
from shared.messages import OpenRequest
from shared.sampling import SamplingParams, race_noise, race_winner

PROMPT = (1, 46, 47, 48, 49)


def test_the_race_on_q_leads():
    rng = np.random.default_rng(0)
    ids = rng.choice(300, size=8, replace=False)
    logprobs = np.log(rng.dirichlet(np.ones(8)))
    race = Race(seed=11, temperature=0.7)
    for position in (5, 6, 40):
        scores = RaceKeys(race, 300).behind_winner(logprobs, ids, position)
        warped = np.zeros(300)
        warped[ids] = np.exp(logprobs / race.temperature)
        assert ids[np.argmax(scores)] == race_winner(warped, race_noise(11, position, 300))
        assert scores.max() == 0 and (scores <= 0).all()


def test_a_race_only_under_its_rule():
    sampled = SamplingParams(temperature=0.7)
    assert Race.of(AcceptanceMode.EXPONENTIAL_RACE, 3, sampled) == Race(3, 0.7)
    assert Race.of(AcceptanceMode.TOPK_DRAFTS, 3, sampled) is None
    assert Race.of(AcceptanceMode.EXPONENTIAL_RACE, 3, SamplingParams()) is None


def test_the_tree_follows_the_race_winners(tiny_target, tiny_bundle):
    """The best node of a race-aware tree is the race winner on q at the first position, and
    the chain of winners has score 0 all the way down, so it is drafted to the full depth."""
    drafter = MoaDrafter(tiny_bundle, precision=Precision.INT8, max_depth=4, lookup_nodes=0,
                         race_aware=True)
    drafter.reset(PROMPT)
    context = list(PROMPT) + [30]
    drafter.add_activations(0, np.zeros((len(PROMPT), drafter.width), dtype=np.float32))
    logprobs, ids = drafter._sync(context)
    drafter.follow_race(Race(5, 0.8))
    tree = drafter.propose(context, 32)
    winner = RaceKeys(Race(5, 0.8), tiny_target.model.config.vocab_size).behind_winner(logprobs, ids, len(context))
    assert tree.tokens[0] == ids[np.argmax(winner)]
    assert max(tree.depths()) == 3
    drafter.follow_race(None)
    assert drafter.propose(context, 32).tokens[0] == ids[0]  # by log q again


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_race_aware_drafts_leave_the_text_as_it_was(tiny_target, tiny_bundle, tiny_drafter_dir,
                                                    temperature):
    from cloud_server.moa.activations import ServerActivations

    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    request = OpenRequest(prompt_ids=PROMPT, max_new_tokens=24,
                          sampling=SamplingParams(temperature=temperature, seed=9),
                          acceptance=AcceptanceMode.EXPONENTIAL_RACE)
    plain = decode_in_process(tiny_target, request, None, 0)
    texts = []
    for aware in (True, False):
        drafter = MoaDrafter(tiny_bundle, precision=Precision.INT8, race_aware=aware)
        run = decode_in_process(tiny_target, request, drafter, 16, server)
        assert (drafter._race is not None) == aware  # the session's race reached the drafter
        texts.append([t for v in run.verdicts for t in v.tokens])
    assert texts[0] == texts[1] == [t for v in plain.verdicts for t in v.tokens]
