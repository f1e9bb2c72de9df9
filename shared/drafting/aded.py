"""ADED as a training-free tree drafter: an adaptive tri-gram table, searched best-first with an
upper-confidence bonus learned from verdicts.

Taken from ADED (Liu et al. 2024, "Adaptive Draft-Verification for Efficient Large Language Model
Decoding", arXiv 2407.12021; liuxukun2000/Adaptix), docs/architecture.md, Drafters:
  - the tri-gram "LLM representative": (prev2, prev1) -> counts of next tokens, updated with every
    token the target commits, so the draft distribution follows the running text;
  - a draft construction that balances exploitation (likely tokens) against exploration
    (contexts whose drafts have rarely been checked) with an MCTS-style confidence term, its
    result one token tree that the target verifies in a single pass.
Not taken, or this implementation's own choices:
  - no pre-built corpus matrix (the paper's draftretriever datastore): the table starts from the
    prompt alone and grows with the generation;
  - no MCTS simulations or PUCT visit counts: one best-first expansion (EAGLE-2's rule, see
    docs/architecture.md) whose node value is the product over its path of table probability times a
    UCB1 bound on how often drafts from that tri-gram context were accepted in past verdicts;
  - back-off to a bigram (prev1) table for unseen pairs, and exponential forgetting of old counts
    (per committed token) so recent text outweighs old text.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Hashable, Sequence

import numpy as np

from shared.drafting.base import DrafterName, TextDrafter
from shared.drafting.trie import TokenTrie
from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.tree import ROOT, DraftTree

NO_TOKEN = -1  # prev2 before the text's first token
SAMPLED_SEARCH = 4  # candidate trie for sampled drafts: this many times the node budget
Key = tuple[int, int]  # (prev2, prev1)


def context_key(text: Sequence[int], i: int) -> Key:
    """The tri-gram context that predicts `text[i]`."""
    return (text[i - 2] if i >= 2 else NO_TOKEN, text[i - 1])


@dataclass
class _Counts:
    """Counts of the tokens seen after one context, last decayed at text position `step`."""
    next: dict[int, float]
    step: int


class AdedDrafter(TextDrafter):
    name = DrafterName.ADED
    # The rule it drafts best for under sampling, measured (results log, `sampling`).
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, max_depth: int = 10, top_k: int = 4, forget: float = 0.997,
                 explore: float = 0.5, min_count: float = 0.01) -> None:
        self.max_depth = max_depth
        self.top_k = top_k  # children considered per expanded node
        self.forget = forget  # count decay per committed token: half-life ~230 tokens
        self.explore = explore  # UCB1 exploration constant
        self.min_count = min_count  # decayed counts below this are dropped
        self.reset(())

    def reset(self, prompt: Sequence[int]) -> None:
        self._trigram: dict[Key, _Counts] = {}
        self._bigram: dict[int, _Counts] = {}
        self._learned = 0  # how many tokens of the committed text the tables hold
        self._tried: dict[Key, int] = {}  # verdicts that checked drafts made from a context
        self._hits: dict[Key, int] = {}  # ... in which one of those drafts was accepted
        self._total_tried = 0
        self._proposed: DraftTree | None = None
        self._learn(prompt)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        if len(context) < self._learned:
            self.reset(context)  # not a continuation of the learned text: a new generation
        # Learning here, not in observe, also covers the prefill's token that no verdict reports.
        self._learn(context)
        self._proposed = self._search(context, max_nodes).best_tree(max_nodes)
        return self._proposed

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        """Drafts drawn from q = the n-gram counts after each context (its top_k), normalised,
        out of a candidate trie searched a few times wider than the budget."""
        if len(context) < self._learned:
            self.reset(context)
        self._learn(context)
        proposal = self._search(context, SAMPLED_SEARCH * max_nodes).sampled_tree(max_nodes, rng)
        self._proposed = proposal.tree
        return proposal

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Credits each checked branching point: the root and every accepted node that had
        children. Its drafts were tried; they hit when the target took one of them."""
        if tree != self._proposed:
            return  # someone else's tree (the caller's fallback): nothing of ours was tested
        tail = [*context[-2:], *tokens]
        offset = len(tail) - len(tokens)
        has_children = set(tree.parents)
        for j, node in enumerate((ROOT, *accepted_nodes)):
            if node not in has_children:
                break
            key = context_key(tail, offset + j)
            self._tried[key] = self._tried.get(key, 0) + 1
            self._hits[key] = self._hits.get(key, 0) + (j < len(accepted_nodes))
            self._total_tried += 1

    def _learn(self, context: Sequence[int]) -> None:
        for i in range(max(self._learned, 1), len(context)):
            key = context_key(context, i)
            self._count(self._bigram, key[1], context[i], i)
            if key[0] != NO_TOKEN:
                self._count(self._trigram, key, context[i], i)
        self._learned = len(context)

    def _count(self, table: dict[Any, _Counts], key: Hashable, token: int, step: int) -> None:
        entry = table.get(key)
        if entry is None:
            table[key] = _Counts({token: 1.0}, step)
            return
        # Decaying on touch costs O(entry) instead of touching the whole table every token.
        scale = self.forget ** (step - entry.step)
        entry.next = {t: c * scale for t, c in entry.next.items() if c * scale >= self.min_count}
        entry.next[token] = entry.next.get(token, 0.0) + 1.0
        entry.step = step

    def _search(self, context: Sequence[int], max_nodes: int) -> TokenTrie:
        """Best-first: always expand the candidate with the highest optimistic path value.
        Siblings' values are proportional to their counts, so each node's children, scores
        normalised, are the n-gram distribution after it (over its top_k)."""
        trie = TokenTrie()
        if not context:
            return trie
        heap: list[tuple[float, int, int, Key, int]] = []  # (-value, parent, token, key, depth)
        self._push_children(heap, ROOT, context_key(context, len(context)), 1.0, 0)
        while heap and len(trie) < max_nodes:
            neg_value, parent, token, key, depth = heapq.heappop(heap)
            node = trie.add(parent, token, -neg_value)
            if depth + 1 < self.max_depth:
                self._push_children(heap, node, (key[1], token), -neg_value, depth + 1)
        return trie

    def _push_children(self, heap: list, parent: int, key: Key, value: float, depth: int) -> None:
        entry = self._trigram.get(key) or self._bigram.get(key[1])
        if entry is None:
            return
        total = sum(entry.next.values())
        bound = self._confidence(key)
        for token, count in heapq.nlargest(self.top_k, entry.next.items(), key=itemgetter(1)):
            heapq.heappush(heap, (-value * count / total * bound, parent, token, key, depth))

    def _confidence(self, key: Key) -> float:
        """UCB1 on the rate at which drafts from `key` were accepted, capped at 1 so a path's
        value never grows with depth; an untried context gets the benefit of the doubt."""
        tried = self._tried.get(key, 0)
        if tried == 0:
            return 1.0
        mean = self._hits[key] / tried
        return min(1.0, mean + self.explore * math.sqrt(math.log(self._total_tried) / tried))
