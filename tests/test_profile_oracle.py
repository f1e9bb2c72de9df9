"""The profile oracle (testkit/profile_oracle.py), which benchmarks of the server lend their
edge clients: its trees are what it says, and through a server at lock-step each round gets
exactly the number of tokens it drew accepted, so its tau is the profile's."""
from __future__ import annotations

import asyncio

import pytest

from cloud_server.reference import plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafter_source import DrafterPool
from shared.messages import OpenRequest, Pace
from shared.tree import ROOT
from edge_client.offline import LinkPolicy
from testkit.profile_oracle import ProfileOracle, load_profile
from testkit.tiny_prompts import MAX_NEW, PROMPTS


UNPIPELINED = LinkPolicy(pipeline=False)


class Recording(ProfileOracle):
    """Keeps, for each verdict, the draws its round was sent with and what was accepted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (drawn, right drafted that fits the answer's length, accepted)
        self.rounds: list[tuple[int, int, int]] = []

    def observe(self, context, tree, accepted_nodes, tokens):
        at = len(context) - self._prompt_length
        right = len(self.answer[at: at + min(self.max_depth, len(tree))])
        room = MAX_NEW - at  # a round may end on an accepted draft at max_new_tokens
        self.rounds.append((self.accepted(at), min(right, room), len(accepted_nodes)))


def test_a_tree_is_right_for_its_draw_then_wrong():
    oracle = ProfileOracle((0.9, 0.6, 0.3), vocab_size=50)
    oracle.answer = [5, 6, 7, 8, 9]
    oracle.reset([1, 2])
    for committed in range(4):
        tree = oracle.propose([1, 2, *oracle.answer[:committed]], 8)
        assert len(tree) == 8 and all(p == ROOT or p < i for i, p in enumerate(tree.parents))
        chain = [0] + [i for i, p in enumerate(tree.parents) if p != ROOT]
        drafted = [tree.tokens[i] for i in chain]
        right = oracle.answer[committed: committed + 3]
        good = min(oracle.accepted(committed), len(right))
        assert drafted[:good] == right[:good]
        assert len(drafted) == len(right) and all(
            d != r for d, r in zip(drafted[good:], right[good:]))
        siblings = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == ROOT]
        assert right[0] not in siblings[1:] and len(set(siblings)) == len(siblings)


def test_the_draws_follow_the_profile():
    oracle = ProfileOracle(load_profile(), vocab_size=50)
    mean = sum(oracle.accepted(at) for at in range(4000)) / 4000
    assert mean + 1 == pytest.approx(oracle.tau, abs=0.1)
    assert oracle.accepted(7) == ProfileOracle(load_profile(), 50).accepted(7)


def test_a_rising_profile_is_refused():
    with pytest.raises(ValueError, match="falls with depth"):
        ProfileOracle((0.5, 0.7), vocab_size=50)


def test_through_the_server_each_round_accepts_what_it_drew(tiny_server, tiny_target):
    """At lock-step and unpipelined: at the server's pace a draft may be verified at a later
    base (re-rooted), and a pipelined one is drafted ahead under a guess of the target's own
    token, as any drafter's is."""
    oracle = Recording((0.9, 0.7, 0.5, 0.3), vocab_size=tiny_target.vocab_size)

    async def generate(prompt, answer):
        oracle.answer = answer
        async with EdgeClient(tiny_server.address, ClientOptions("pld", 8, MAX_NEW, pace=Pace.LOCKSTEP,
                                                           link_policy=UNPIPELINED),
                              drafters=DrafterPool(lambda: oracle)) as client:
            return await client.generate(OpenRequest(prompt_ids=tuple(prompt),
                                                     max_new_tokens=MAX_NEW))

    for prompt in PROMPTS:
        answer = plain_greedy(tiny_target, prompt, MAX_NEW)
        result = asyncio.run(generate(prompt, answer))
        assert result.output_ids == answer
    assert all(accepted == min(drawn, right)
                                 for drawn, right, accepted in oracle.rounds)

