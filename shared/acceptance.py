"""Acceptance rules: which path of a verified draft tree the target agrees with (docs/architecture.md, Verification).

Pure functions of the tree and the target's outputs; no model, no transport. The sampling rules
take p already warped (`shared.sampling.warp`) and are lossless: the committed tokens are
distributed exactly as if the target had sampled them one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import numpy as np

from shared.errors import InvalidRequest
from shared.sampling import race_noise, race_winner, sample
from shared.draft_q import QRows
from shared.tree import ROOT, DraftTree


class AcceptanceMode(Enum):
    """Which rule verifies a tree; each asks the drafter for something different."""

    GREEDY = "greedy"  # target argmax; tokens only
    TOPK_DRAFTS = "topk-drafts"  # drafts chosen deterministically (e.g. top-k of q); tokens only
    SAMPLED_DRAFTS = "sampled-drafts"  # drafts sampled from q; q's top-k sent along
    EXPONENTIAL_RACE = "exponential-race"  # drafts are race winners under q; tokens and a seed


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: tuple[int, ...]  # draft node indices, root to leaf
    tokens: tuple[int, ...]  # accepted draft tokens then the bonus token


def accept_greedy(tree: DraftTree, target_argmax: np.ndarray) -> Acceptance:
    """Greedy acceptance: from the root, follow the child equal to the target's argmax.

    target_argmax: [1 + n]; entry 0 is the target's choice after the committed text, entry
    i + 1 its choice after draft node i. The walk stops at the first node with no matching
    child; the bonus token is the target's argmax there. Lossless because every committed token
    is the target's argmax given exactly the committed prefix before it, which is what plain
    greedy decoding emits (speculative decoding, Leviathan et al. 2023, section 2).
    """
    accepted: list[int] = []
    node = ROOT
    while True:
        want = int(target_argmax[node + 1])
        match = tree.child(node, want)
        if match is None:
            tokens = tuple(tree.tokens[i] for i in accepted) + (want,)
            return Acceptance(tuple(accepted), tokens)
        accepted.append(match)
        node = match


# One verification step at a node: (accepted child, its token) or (None, the bonus token).
_Step = Callable[[int], tuple[int | None, int]]


def _walk(tree: DraftTree, step: _Step) -> Acceptance:
    """Follows accepted children from the root; stops at the first node whose step gives a bonus."""
    accepted: list[int] = []
    node = ROOT
    while True:
        child, token = step(node)
        if child is None:
            return Acceptance(tuple(accepted), tuple(tree.tokens[i] for i in accepted) + (token,))
        accepted.append(child)
        node = child


def _normalise(probs: np.ndarray) -> np.ndarray:
    """probs: [vocab] float64 summing to 1."""
    probs = np.asarray(probs, dtype=np.float64)  # [vocab]
    return probs / probs.sum()


def _without(probs: np.ndarray, token: int) -> np.ndarray:
    """probs: [vocab] conditioned on not being `token`."""
    rest = probs.copy()  # [vocab]
    rest[token] = 0.0
    # Every token drawn: nothing is left to draw, and the caller has no candidate left.
    return _normalise(rest) if rest.sum() > 0 else rest


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)), p, q: [vocab]: what p still owes after q's candidate was rejected."""
    excess = np.maximum(p - q, 0.0)  # [vocab]
    if excess.sum() <= 0:
        # p == q up to rounding: exact arithmetic accepts with certainty, so this rejection
        # is a rounding artefact; keep p rather than divide by zero.
        return p
    return _normalise(excess)


def accept_topk_drafts(tree: DraftTree, p: np.ndarray, rng: np.random.Generator) -> Acceptance:
    """Recursive rejection sampling with deterministic candidates (EAGLE-2 style, tokens only).

    p: [1 + n, vocab] target probabilities, warped; row 0 after the committed text, row i + 1
    after draft node i. At a node, try its children in draft order with the residual r = p[node]:
    accept child x with probability r(x); on rejection r <- r(. | not x), i.e. set r(x) = 0 and
    renormalise. If no child is accepted, the bonus token is drawn from r.

    Lossless: a candidate chosen without randomness is speculative sampling with q a point mass
    on x, for which min(1, r(x)/q(x)) = r(x) and norm(max(0, r - q)) = r(. | not x) (Chen et
    al. 2023, Algorithm 2; SpecTr, Sun et al. 2023; as in EAGLE/EAGLE-2's evaluate_posterior,
    Li et al. 2024). The node's output is r(x) on x plus (1 - r(x)) * r(. | not x), which is r,
    and by induction over the remaining candidates every node's output follows p; the walk then
    continues from the accepted child with the target's p after it. Candidates may be any
    function of the drafter's state that does not see this rule's coins.
    """
    def step(node: int) -> tuple[int | None, int]:
        residual = _normalise(p[node + 1])  # [vocab]
        for child in tree.children(node):
            token = tree.tokens[child]
            if rng.random() < residual[token]:
                return child, token
            residual = _without(residual, token)
        return None, sample(residual, rng)

    return _walk(tree, step)


def accept_sampled_drafts(tree: DraftTree, p: np.ndarray, q: np.ndarray | QRows,
                          rng: np.random.Generator,
                          without_replacement: bool = False) -> Acceptance:
    """Multi-step speculative sampling over a tree whose children were drawn from q (SpecInfer).

    p, q: [1 + n, vocab]; row 0 after the committed text, row i + 1 after draft node i; q is the
    drafter's distribution its children at that node were drawn from (zero outside the top-k it
    sent). Children in draft order: accept x with probability min(1, r(x) / q(x)) where r starts
    as p; on rejection r <- norm(max(0, r - q)), and for drafts drawn without replacement also
    q <- q(. | not x). If every child is rejected, the bonus token is drawn from r.

    Lossless (SpecInfer, Miao et al. 2024, section 4.3, multi-step speculative sampling;
    Recursive Speculative Decoding, Jeon et al. 2024, for drafts without replacement): with
    x ~ q, a step emits y with probability min(r, q)(y) + (1 - sum min(r, q)) * norm(max(0, r -
    q))(y) = r(y) (the speculative-sampling identity, Leviathan et al. 2023, section 2.3), and
    each later candidate is again a draw from the current q, so by induction over the children
    the node's output follows p.

    With replacement, children are i.i.d. draws with duplicates kept as separate nodes. A
    drafter that draws i.i.d. and merges duplicates must set without_replacement: the first
    occurrences of i.i.d. draws are a without-replacement sequence, and verifying them with the
    i.i.d. rule skips the residual updates of the merged draws, which is biased.
    Raises InvalidRequest for a child that q could not have drawn.
    """
    def step(node: int) -> tuple[int | None, int]:
        residual = _normalise(p[node + 1])  # [vocab]
        draft = np.asarray(q[node + 1], dtype=np.float64)  # [vocab], mass left to draw from
        for child in tree.children(node):
            token = tree.tokens[child]
            if draft[token] <= 0:
                raise InvalidRequest(f"draft node {child} holds token {token}, which its q "
                                     "could not have drawn (q = 0 there)")
            q_now = _normalise(draft)  # [vocab]
            if rng.random() * q_now[token] < residual[token]:
                return child, token
            residual = _residual(residual, q_now)
            if without_replacement:
                draft = _without(draft, token)
        return None, sample(residual, rng)

    return _walk(tree, step)


def accept_exponential_race(tree: DraftTree, p: np.ndarray, seed: int,
                            position: int) -> Acceptance:
    """Exponential-race verification (ERSD, Kobus & Gunduz 2025, arXiv 2504.15475).

    p: [1 + n, vocab]; row 0 after the committed text, row i + 1 after draft node i. position is
    the absolute position of the token row 0 predicts (the number of tokens before it, prompt
    included); the row after a node at depth d (0 for children of the committed text) predicts
    position + d + 1. The token at every position is the winner of the race under p with noise
    race_noise(seed, that position): walk from the root, follow the child equal to the winner,
    and emit the winner at the first node with none.

    Lossless: the winner is an exact sample from p (see race_winner), and the noise at a position
    is independent of the noise that chose the earlier tokens, so the committed text is sampled
    token by token from the target. It is the same text whatever the drafter proposes: the tree
    only decides how many winners one round commits, so the output is a deterministic function
    of (seed, prompt); the drafter proposes winners of the same races under its q.
    """
    depths = tree.depths()  # [n]
    vocab = p.shape[-1]

    def step(node: int) -> tuple[int | None, int]:
        depth = 0 if node == ROOT else int(depths[node]) + 1
        winner = race_winner(p[node + 1], race_noise(seed, position + depth, vocab))
        return tree.child(node, winner), winner

    return _walk(tree, step)
