"""The sampling acceptance rules reproduce the target's distribution (docs/architecture.md, Verification).

A toy target P and drafter Q give a fixed random next-token distribution for every prefix of a
6-token vocabulary. Each trial decodes two tokens in rounds, exactly as the split decoder does:
the drafter grows a random tree (0-3 children a node, two levels), the target's rows are
looked up along it, a rule commits tokens. The first token, and the first two jointly, must
follow P; deliberately broken rules must not.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import shared.acceptance as acceptance
from shared.acceptance import (Acceptance, accept_exponential_race, accept_greedy,
                               accept_sampled_drafts, accept_topk_drafts)
from edge_client.drafters.draft_trees import sampled_tree
from shared.drafting.trie import TokenTrie
from shared.draft_q import NodeQ, QRows
from shared.errors import InvalidRequest
from shared.rerooting import reroot
from shared.sampling import SamplingParams, race_noise, race_winner, warp
from shared.tree import ROOT, DraftTree

VOCAB = 6
TRIALS = 20_000
TEETH_TRIALS = 5_000  # for broken rules whose bias dwarfs the bound at a quarter of the trials
PROMPT = (1, 4, 2)  # ERSD keys its noise by absolute position, so the prompt length matters


class ToyLM:
    """A fixed random next-token distribution for every prefix: [VOCAB], Dirichlet(0.7), half
    blended with `blend`'s if given, cut to its top_k (a drafter sends only its top-k)."""

    def __init__(self, seed: int, top_k: int = VOCAB, blend: ToyLM | None = None) -> None:
        self.seed, self.top_k, self.blend = seed, top_k, blend
        self.cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, prefix: tuple[int, ...]) -> np.ndarray:
        return self._lookup(prefix)[0]

    def cdf(self, prefix: tuple[int, ...]) -> np.ndarray:
        return self._lookup(prefix)[1]

    def _lookup(self, prefix: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        if prefix not in self.cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            probs = rng.dirichlet(np.full(VOCAB, 0.7))  # [VOCAB]
            if self.blend is not None:
                probs = 0.5 * probs + 0.5 * self.blend(prefix)
            probs[np.argsort(-probs)[self.top_k:]] = 0.0
            probs /= probs.sum()
            cdf = np.cumsum(probs)  # [VOCAB]
            self.cache[prefix] = probs, cdf / cdf[-1]
        return self.cache[prefix]


P = ToyLM(seed=1)  # the target
Q = ToyLM(seed=2, top_k=4, blend=P)  # a drafter that roughly agrees with P
Q_FAR = ToyLM(seed=3, top_k=4)  # one that does not

Picker = Callable[[ToyLM, tuple[int, ...], int, np.random.Generator], list[int]]


def pick_top(q: ToyLM, context: tuple[int, ...], k: int, rng: np.random.Generator) -> list[int]:
    return np.argsort(-q(context), kind="stable")[:k].tolist()


def pick_without_replacement(q: ToyLM, context: tuple[int, ...], k: int,
                             rng: np.random.Generator) -> list[int]:
    """k draws from q without replacement (Gumbel-top-k, Kool et al. 2019)."""
    with np.errstate(divide="ignore"):
        keys = np.log(q(context)) + rng.gumbel(size=VOCAB)  # [VOCAB]
    return [t for t in np.argsort(-keys)[:k].tolist() if q(context)[t] > 0]


def pick_iid(q: ToyLM, context: tuple[int, ...], k: int, rng: np.random.Generator) -> list[int]:
    return np.searchsorted(q.cdf(context), rng.random(k), side="right").tolist()


def pick_iid_merged(q: ToyLM, context: tuple[int, ...], k: int,
                    rng: np.random.Generator) -> list[int]:
    """k i.i.d. draws with repeats merged, first occurrences in order."""
    return list(dict.fromkeys(pick_iid(q, context, k, rng)))


def grow(q: ToyLM, pick: Picker, prefix: tuple[int, ...], rng: np.random.Generator,
         max_children: int = 3, max_depth: int = 3) -> DraftTree:
    """A random draft tree: 0 to max_children picks a node, `pick` choosing their tokens."""
    tokens: list[int] = []
    parents: list[int] = []

    def visit(node: int, context: tuple[int, ...], depth: int) -> None:
        k = int(rng.integers(0, max_children + 1))
        if depth == max_depth or k == 0:
            return
        for token in pick(q, context, k, rng):
            tokens.append(token)
            parents.append(node)
            visit(len(tokens) - 1, context + (token,), depth + 1)

    visit(ROOT, prefix, 0)
    return DraftTree(tuple(tokens), tuple(parents))


def rows(model: ToyLM, prefix: tuple[int, ...], tree: DraftTree) -> np.ndarray:
    """[1 + n, VOCAB]: the model after the prefix, then after each node's path."""
    contexts = [prefix] + [prefix + tuple(tree.path_tokens(i)) for i in range(len(tree))]
    return np.stack([model(c) for c in contexts])


Rule = Callable[[DraftTree, tuple[int, ...]], Acceptance]


def decode_pairs(rule: Rule, drafter: Callable[[tuple[int, ...]], DraftTree],
                 trials: int = TRIALS) -> np.ndarray:
    """counts: [VOCAB, VOCAB] of the first two tokens after PROMPT over `trials` decodes."""
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for _ in range(trials):
        text = PROMPT
        while len(text) < len(PROMPT) + 2:
            text += rule(drafter(text), text).tokens
        counts[text[len(PROMPT)], text[len(PROMPT) + 1]] += 1
    return counts


def target_pairs() -> np.ndarray:
    """[VOCAB, VOCAB]: P(t0) P(t1 | t0) after PROMPT."""
    return np.stack([P(PROMPT)[t] * P(PROMPT + (t,)) for t in range(VOCAB)])


def tv_bound(expected: np.ndarray, trials: int, false_alarm: float = 1e-6) -> float:
    """A total-variation distance the empirical law of `trials` exact draws from `expected`
    exceeds with probability below `false_alarm`, whatever the seed.

    E[TV] <= 0.5 * sum_k sqrt(p_k (1 - p_k) / trials) (Jensen, cell by cell), and one draw moves
    the TV by at most 1 / trials, so McDiarmid's inequality adds sqrt(ln(1/false_alarm) / (2
    trials)). Here about 0.025 for the first token and 0.032 for the pair at 20k trials.
    """
    p = expected.ravel()
    mean = 0.5 * np.sqrt(p * (1 - p) / trials).sum()
    return float(mean + np.sqrt(np.log(1 / false_alarm) / (2 * trials)))


def distances(counts: np.ndarray) -> tuple[float, float, float, float]:
    """(TV of the first token, its bound, TV of the pair, its bound)."""
    expected = target_pairs()  # [VOCAB, VOCAB]
    trials = int(counts.sum())
    freq = counts / trials  # [VOCAB, VOCAB]
    first = 0.5 * np.abs(freq.sum(1) - expected.sum(1)).sum()
    pair = 0.5 * np.abs(freq - expected).sum()
    return first, tv_bound(expected.sum(1), trials), pair, tv_bound(expected, trials)


def assert_follows_target(counts: np.ndarray) -> None:
    first, first_bound, pair, pair_bound = distances(counts)
    assert first < first_bound, f"first token: TV {first:.4f} >= {first_bound:.4f}"
    assert pair < pair_bound, f"first two tokens: TV {pair:.4f} >= {pair_bound:.4f}"


def assert_misses_target(counts: np.ndarray) -> None:
    first, first_bound, pair, pair_bound = distances(counts)
    assert first > first_bound or pair > pair_bound, (
        f"a broken rule passed: TV {first:.4f} (bound {first_bound:.4f}), "
        f"pair {pair:.4f} (bound {pair_bound:.4f})")


def topk_rule(rng: np.random.Generator) -> Rule:
    return lambda tree, text: accept_topk_drafts(tree, rows(P, text, tree), rng)


def sampled_rule(q: ToyLM, rng: np.random.Generator, without_replacement: bool) -> Rule:
    return lambda tree, text: accept_sampled_drafts(
        tree, rows(P, text, tree), rows(q, text, tree), rng, without_replacement)


def drafter(q: ToyLM, pick: Picker, seed: int,
            max_children: int = 3) -> Callable[[tuple[int, ...]], DraftTree]:
    """Random trees two deep: a third level cannot change the first two tokens, only cost time."""
    rng = np.random.default_rng(seed)  # the drafter's own stream, apart from the verifier's
    return lambda text: grow(q, pick, text, rng, max_children, max_depth=2)


def test_topk_drafts_follow_target():
    assert_follows_target(decode_pairs(topk_rule(np.random.default_rng(10)),
                                       drafter(Q, pick_top, 11)))


@pytest.mark.slow
def test_topk_drafts_without_renormalising_miss_target(monkeypatch):
    """Teeth: accepting later candidates with the unrenormalised p(x) under-weights them."""
    def zero_only(probs: np.ndarray, token: int) -> np.ndarray:
        rest = probs.copy()  # [vocab]
        rest[token] = 0.0
        return rest

    monkeypatch.setattr(acceptance, "_without", zero_only)
    assert_misses_target(decode_pairs(topk_rule(np.random.default_rng(12)),
                                      drafter(Q, pick_top, 13)))


@pytest.mark.parametrize("q, pick, without_replacement", [
    (Q_FAR, pick_iid, False),
    (Q, pick_without_replacement, True),
    # merged i.i.d. draws are draws without replacement
    pytest.param(Q, pick_iid_merged, True, marks=pytest.mark.slow),
], ids=["iid", "without-replacement", "iid-merged"])
def test_sampled_drafts_follow_target(q, pick, without_replacement):
    rule = sampled_rule(q, np.random.default_rng(20), without_replacement)
    assert_follows_target(decode_pairs(rule, drafter(q, pick, 21)))


def test_sampled_drafts_resampling_from_p_miss_target(monkeypatch):
    """Teeth: after a rejection, drawing from p instead of norm(max(0, p - q))."""
    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    rule = sampled_rule(Q, np.random.default_rng(22), without_replacement=False)
    assert_misses_target(decode_pairs(rule, drafter(Q, pick_iid, 23), TEETH_TRIALS))


@pytest.mark.slow
def test_sampled_drafts_merged_iid_verified_as_iid_miss_target():
    """Teeth: merged i.i.d. draws verified with the i.i.d. rule (q not updated) are biased;
    up to 6 draws a node make merges common enough to show it."""
    rule = sampled_rule(Q, np.random.default_rng(24), without_replacement=False)
    assert_misses_target(decode_pairs(rule, drafter(Q, pick_iid_merged, 25, max_children=6)))


def test_sampled_drafts_reject_a_token_q_could_not_draw():
    q = Q(PROMPT)
    impossible = int(np.flatnonzero(q == 0)[0])
    tree = DraftTree((impossible,), (ROOT,))
    with pytest.raises(InvalidRequest, match="could not have drawn"):
        accept_sampled_drafts(tree, rows(P, PROMPT, tree), rows(Q, PROMPT, tree),
                              np.random.default_rng(0))


def race_step(q: ToyLM, seed: int, text: tuple[int, ...], extra: int,
              rng: np.random.Generator) -> list[int]:
    """The winner of the race at this position under q, then `extra` other tokens."""
    winner = race_winner(q(text), race_noise(seed, len(text), VOCAB))
    others = [t for t in rng.permutation(VOCAB).tolist() if t != winner]
    return [winner] + others[:extra]


def race_drafter(q: ToyLM, seed: int, extra: int, depth: int,
                 rng: np.random.Generator) -> Callable[[tuple[int, ...]], DraftTree]:
    """A chain of q's race winners, each with `extra` random siblings."""
    def draft(text: tuple[int, ...]) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        node, context = ROOT, text
        for _ in range(depth):
            level = race_step(q, seed, context, extra, rng)
            for token in level:
                tokens.append(token)
                parents.append(node)
            node, context = len(tokens) - len(level), context + (level[0],)
        return DraftTree(tuple(tokens), tuple(parents))

    return draft


def race_rule(seed: int) -> Rule:
    return lambda tree, text: accept_exponential_race(tree, rows(P, text, tree), seed, len(text))


def race_decode(seed: int, draft: Callable[[tuple[int, ...]], DraftTree],
                n_tokens: int) -> tuple[int, ...]:
    text = PROMPT
    while len(text) < len(PROMPT) + n_tokens:
        text += race_rule(seed)(draft(text), text).tokens
    return text[len(PROMPT):len(PROMPT) + n_tokens]


def race_reference(seed: int, n_tokens: int) -> tuple[int, ...]:
    """Token-by-token sampling with the race under P, no drafting."""
    text = PROMPT
    for _ in range(n_tokens):
        text += (race_winner(P(text), race_noise(seed, len(text), VOCAB)),)
    return text[len(PROMPT):]


def test_exponential_race_output_is_independent_of_the_drafter():
    rng = np.random.default_rng(30)
    for seed in range(40):
        expected = race_reference(seed, 8)
        drafters = [
            lambda text: DraftTree((), ()),  # no proposal: the root's winner only
            race_drafter(Q_FAR, seed, extra=0, depth=3, rng=rng),
            race_drafter(Q, seed, extra=2, depth=3, rng=rng),
            race_drafter(P, seed, extra=1, depth=4, rng=rng),  # a perfect drafter
            lambda text: grow(Q, pick_without_replacement, text, rng),  # ignores the race
        ]
        for draft in drafters:
            assert race_decode(seed, draft, 8) == expected


def test_exponential_race_perfect_drafter_is_fully_accepted():
    draft = race_drafter(P, seed=5, extra=0, depth=4, rng=np.random.default_rng(0))
    tree = draft(PROMPT)
    verdict = race_rule(5)(tree, PROMPT)
    assert verdict.accepted_nodes == (0, 1, 2, 3) and len(verdict.tokens) == 5


def race_pairs(seeds: range, rng: np.random.Generator) -> np.ndarray:
    """counts: [VOCAB, VOCAB] of the first two tokens, one decode per seed."""
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for seed in seeds:
        counts[race_decode(seed, race_drafter(Q, seed, extra=1, depth=2, rng=rng), 2)] += 1
    return counts


@pytest.mark.slow
def test_exponential_race_follows_target_over_seeds():
    assert_follows_target(race_pairs(range(TRIALS), np.random.default_rng(31)))


@pytest.mark.slow
def test_exponential_race_with_noise_shared_across_positions_misses_target(monkeypatch):
    """Teeth: one race for every position correlates the tokens."""
    monkeypatch.setattr(acceptance, "race_noise",
                        lambda seed, position, vocab: race_noise(seed, 0, vocab))
    assert_misses_target(race_pairs(range(TEETH_TRIALS), np.random.default_rng(32)))


def test_greedy_p_reduces_every_rule_to_greedy_acceptance():
    """temperature 0 warps p to a one-hot, and each sampling rule then commits accept_greedy's
    tokens: greedy mode is untouched by the sampling rules."""
    rng = np.random.default_rng(40)
    for _ in range(300):
        text = PROMPT + tuple(rng.integers(0, VOCAB, size=2).tolist())
        tree = grow(Q, pick_without_replacement, text, rng)
        logits = np.log(rows(P, text, tree))  # [1 + n, VOCAB]
        p = warp(logits, SamplingParams())  # [1 + n, VOCAB] one-hot
        expected = accept_greedy(tree, logits.argmax(-1))
        assert accept_topk_drafts(tree, p, rng) == expected
        assert accept_sampled_drafts(tree, p, rows(Q, text, tree), rng, True) == expected
        assert accept_exponential_race(tree, p, seed=3, position=len(text)) == expected


def trie_of(q: ToyLM, prefix: tuple[int, ...], depth: int = 2) -> TokenTrie:
    """Every continuation q allows, `depth` deep, each node scored with its q probability."""
    trie = TokenTrie()

    def visit(node: int, context: tuple[int, ...], level: int) -> None:
        if level == depth:
            return
        probs = q(context)
        for token in np.flatnonzero(probs).tolist():
            visit(trie.add(node, token, float(probs[token])), context + (token,), level + 1)

    visit(ROOT, prefix, 0)
    return trie


def trie_sampled(text: tuple[int, ...], max_nodes: int, draw: np.random.Generator):
    """pld's and aded's sampled trees."""
    return trie_of(Q, text).sampled_tree(max_nodes, draw)


def moa_sampled(text: tuple[int, ...], max_nodes: int, draw: np.random.Generator):
    """The MoA drafter's sampled trees, with Q standing in for its network."""
    def row(context: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(divide="ignore"):
            return np.log(Q(context)), np.arange(VOCAB)

    def expand(nodes, frontier: list[int]) -> tuple[np.ndarray, np.ndarray]:
        paths = [[nodes.tokens[a] for a in reversed(nodes.ancestors(i))] + [nodes.tokens[i]]
                 for i in frontier]
        rows = [row(text + tuple(path)) for path in paths]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    return sampled_tree(row(text), expand, max_nodes, max_depth=2, beam=4, rng=draw)


def decode_pairs_sampled(max_nodes: int, q_sent: Callable[[tuple], tuple],
                         trials: int = TRIALS, build=trie_sampled) -> np.ndarray:
    """Like decode_pairs, with the drafters' sampled trees (`build`) and the q they send,
    through the wire's QRows, verified by the sampled-drafts rule."""
    draw, verify = np.random.default_rng(30), np.random.default_rng(31)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for _ in range(trials):
        text = PROMPT
        while len(text) < len(PROMPT) + 2:
            proposal = build(text, max_nodes, draw)
            tree = proposal.tree
            q_rows = QRows(tree, q_sent(proposal.q), VOCAB)
            text += accept_sampled_drafts(tree, rows(P, text, tree), q_rows, verify, True).tokens
        counts[text[len(PROMPT)], text[len(PROMPT) + 1]] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("build", [trie_sampled, moa_sampled])
@pytest.mark.parametrize("max_nodes", [1, 3, 6])
def test_drafters_sampled_trees_follow_target(max_nodes, build):
    """The edge's sampled trees (best-first expansion, widths cut by the budget) with the q they
    put on the wire are exact under the sampled-drafts rule."""
    assert_follows_target(decode_pairs_sampled(max_nodes, lambda qs: qs, build=build))


@pytest.mark.slow
@pytest.mark.parametrize("build", [trie_sampled, moa_sampled])
def test_sampled_trees_sent_with_a_wrong_q_miss_target(build):
    flat = lambda qs: tuple(NodeQ(q.node, q.tokens, (1.0,) * len(q.tokens)) for q in qs)  # noqa: E731
    assert_misses_target(decode_pairs_sampled(3, flat, TEETH_TRIALS, build))


def paced(client: Callable[[tuple[int, ...]], DraftTree],
          server: Callable[[tuple[int, ...]], DraftTree] | None
          ) -> Callable[[tuple[int, ...]], DraftTree]:
    """What a server-paced forward verifies (cloud_server/decoding/forward_builder.py): the client's draft
    made one token back, re-rooted at the text (shared/rerooting.py), merged with the server's
    own tree when there is one (never under sampled-drafts)."""
    def propose(text: tuple[int, ...]) -> DraftTree:
        base = text[:-1]
        rerooted = reroot(client(base), len(base), text)
        own = DraftTree((), ()) if server is None else server(text)
        if rerooted is None:
            return own
        tree = rerooted.proposal.tree
        return tree if server is None else tree.merged(own, 64)
    return propose


def deep(q: ToyLM, pick: Picker, seed: int) -> Callable[[tuple[int, ...]], DraftTree]:
    """Three-level trees: after re-rooting one token down, two levels remain."""
    rng = np.random.default_rng(seed)
    return lambda text: grow(q, pick, text, rng, max_depth=3)


@pytest.mark.slow
def test_paced_forwards_mixing_client_and_server_candidates_follow_target():
    propose = paced(deep(Q, pick_top, 40), drafter(Q_FAR, pick_top, 41))
    assert_follows_target(decode_pairs(topk_rule(np.random.default_rng(42)), propose))


@pytest.mark.slow
def test_paced_forwards_with_rerooted_sampled_drafts_follow_target():
    propose = paced(deep(Q, pick_without_replacement, 43), None)
    rule = sampled_rule(Q, np.random.default_rng(44), without_replacement=True)
    assert_follows_target(decode_pairs(rule, propose))


@pytest.mark.slow
def test_a_stale_sampled_draft_verified_without_rerooting_misses_target():
    """Teeth: a draft drawn one token back, verified as if drawn at the text (q of full
    support, so the rule cannot refuse a token instead)."""
    q = ToyLM(seed=2, blend=P)
    stale = deep(q, pick_without_replacement, 45)
    rule = sampled_rule(q, np.random.default_rng(46), without_replacement=True)
    assert_misses_target(decode_pairs(rule, lambda text: stale(text[:-1])))
