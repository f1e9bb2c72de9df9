"""Acceptance rules: which path of a verified draft tree the target agrees with (DESIGN section 4).

Pure functions of the tree and the target's outputs; no model, no transport.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.tree import ROOT, DraftTree


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
        match = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if match is None:
            tokens = tuple(tree.tokens[i] for i in accepted) + (want,)
            return Acceptance(tuple(accepted), tokens)
        accepted.append(match)
        node = match
