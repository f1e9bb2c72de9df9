"""Prompt lookup decoding as a tree: what followed earlier copies of the text's last n-gram.

Prompt lookup decoding (Saxena 2023, apoorvumang/prompt-lookup-decoding; transformers'
`prompt_lookup_num_tokens`) drafts one continuation of the longest matching n-gram. Here several
matches, longest n-gram first and most recent first, are merged into one tree
(docs/architecture.md, Drafters), so when the text has repeated a phrase with different endings each ending gets a branch.
Needs no model and learns nothing from verdicts beyond the committed text itself.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from shared.drafting.base import DrafterName, TextDrafter
from shared.drafting.trie import TokenTrie
from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.tree import DraftTree


class PromptLookupDrafter(TextDrafter):
    """Keeps an index n-gram -> end positions, grown as the committed text grows, so a round
    costs a few dict look-ups however long the text is.

    Scores: a match of an n-gram of length n, the r-th found, weighs
    `n * recency_decay**r`; its i-th continuation token scores `weight * depth_decay**i`, and
    matches that agree on a prefix add up in the trie (frequency counts as evidence).
    """

    name = DrafterName.PLD
    # The rule it drafts best for under sampling, measured (results log, `sampling`).
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, max_ngram: int = 3, max_matches: int = 8, max_depth: int = 10,
                 recency_decay: float = 0.8, depth_decay: float = 0.9) -> None:
        self.max_ngram = max_ngram
        self.max_matches = max_matches
        self.max_depth = max_depth  # tokens drafted per match
        self.recency_decay = recency_decay
        self.depth_decay = depth_decay
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token
        self._indexed = 0  # how many tokens of the committed text the index covers

    def reset(self, prompt: Sequence[int]) -> None:
        self._ends = {}
        self._indexed = 0
        self._index(prompt)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        return self._trie(context).best_tree(max_nodes)

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        """Drafts drawn from q = the matches' evidence for each continuation, normalised."""
        return self._trie(context).sampled_tree(max_nodes, rng)

    def _trie(self, context: Sequence[int]) -> TokenTrie:
        if len(context) < self._indexed:
            self.reset(context)  # not a continuation of the indexed text: a new generation
        self._index(context)
        trie = TokenTrie()
        for rank, (n, end) in enumerate(self._matches(context)):
            continuation = context[end + 1:end + 1 + self.max_depth]
            weight = n * self.recency_decay ** rank
            trie.add_path(continuation,
                          [weight * self.depth_decay ** i for i in range(len(continuation))])
        return trie

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Nothing to learn: the committed tokens reach the index through the next propose."""

    def _index(self, context: Sequence[int]) -> None:
        for end in range(self._indexed, len(context)):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._ends.setdefault(tuple(context[end - n + 1:end + 1]), []).append(end)
        self._indexed = len(context)

    def _matches(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(n, end) of earlier n-grams equal to the text's last n tokens: longest n first, then
        most recent; a position found with a longer n is not counted again with a shorter one."""
        last = len(context) - 1
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            for end in reversed(self._ends.get(tuple(context[last - n + 1:]), ())):
                if len(found) == self.max_matches:
                    return found
                if end != last and end not in seen:
                    seen.add(end)
                    found.append((n, end))
        return found


LOOKUP_NODES = 16  # prompt-lookup nodes merged into another drafter's tree at most (moa_tau)


def with_lookup(lookup: PromptLookupDrafter, context: Sequence[int], max_nodes: int,
                nodes: int, draft: Callable[[int], DraftTree]) -> DraftTree:
    """`draft(room)`'s tree with up to `nodes` prompt-lookup nodes merged in, a quarter of
    `max_nodes` at most: copying is what a small drafter predicts worst and n-gram lookup
    best (REST, He et al., arXiv 2311.08252). The drafter gets the rest of the budget."""
    budget = min(nodes, max_nodes // 4)
    found = lookup.propose(context, budget) if budget > 0 else DraftTree((), ())
    return draft(max_nodes - len(found)).merged(found, max_nodes)
