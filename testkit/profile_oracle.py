"""A drafter that costs nothing and is right as often as a measured drafter is, for benchmarks
of the server (its capacity, its host path) that would otherwise time the edge's drafting or
need the real target's weights.

It is handed the target's own answer (from a plain run of the same prompt, greedy) and drafts
from it: each round, the number of draft tokens the target will accept is drawn from an
acceptance profile, P(accepted >= d) for d = 1, 2, ... (`moa_tau`'s `accepted_by_depth`), so
its tau is 1 + sum_d P(>= d), the measured drafter's. The tree fills the nodes it may send: a
chain right for its first L tokens and wrong after, and wrong siblings of the chain's first
node, as a trained drafter's tree of that size costs the server. It knows nothing of torch, the
wire or the server: clients that run it use one core for many sessions.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.drafting.base import DrafterName, TextDrafter
from shared.draft_q import Proposal
from shared.tree import ROOT, DraftTree

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
DEFAULT_PROFILE = ("moa_tau_gpu", "gpu")  # the shipped MoA drafter in process, trees to 64


def load_profile(result: str = DEFAULT_PROFILE[0], drafter: str = DEFAULT_PROFILE[1]
                 ) -> tuple[float, ...]:
    """P(accepted >= d), d = 1, 2, ...: a drafter's `accepted_by_depth` in a moa_tau result."""
    found = json.loads((RESULTS / f"{result}.json").read_text())["drafters"][drafter]
    return tuple(float(p) for p in found["accepted_by_depth"])


class ProfileOracle(TextDrafter):
    """Greedy. Set `answer` (the target's output ids for the prompt to come) before each
    generation; `reset` takes the prompt."""

    # It stands in for the drafter the client was opened with; the name only labels messages.
    name = DrafterName.PLD
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, profile: Sequence[float], vocab_size: int, seed: int = 0):
        if any(b > a for a, b in zip(profile, profile[1:])) or not 0 <= profile[0] <= 1:
            raise ValueError(f"an acceptance profile falls with depth, within [0, 1]: {profile}")
        self.profile = tuple(profile)
        self.max_depth = len(profile)
        self.vocab_size = vocab_size
        self.seed = seed
        self.answer: Sequence[int] = ()
        self._prompt_length = 0

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.profile)

    def reset(self, prompt: Sequence[int]) -> None:
        self._prompt_length = len(prompt)

    def accepted(self, position: int) -> int:
        """How many draft tokens the round at answer `position` gets accepted: the same for a
        position in every run (its own seeded draw), so methods and runs compare."""
        draw = np.random.default_rng([self.seed, position]).random()
        return sum(draw < p for p in self.profile)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        at = len(context) - self._prompt_length  # answer tokens committed so far
        right = list(self.answer[at: at + min(self.max_depth, max_nodes)])
        if not right:
            return DraftTree((), ())
        good = min(self.accepted(at), len(right))
        chain = right[:good] + [self._other(t, 1) for t in right[good:]]
        decoys = [self._other(right[0], k) for k in range(2, 2 + max_nodes - len(chain))]
        tokens = [chain[0], *decoys, *chain[1:]]
        after_decoys = len(decoys)  # chain[j], j >= 1, sits at after_decoys + j
        parents = [ROOT] * (1 + after_decoys) + [0 if j == 1 else after_decoys + j - 1
                                                 for j in range(1, len(chain))]
        return DraftTree(tuple(tokens), tuple(parents))

    def _other(self, token: int, k: int) -> int:
        """The k-th token after `token` (k >= 1): never `token` itself."""
        return (token + k) % self.vocab_size

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        raise NotImplementedError("ProfileOracle drafts for greedy acceptance only")

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        pass
