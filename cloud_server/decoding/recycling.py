"""Token Recycling: the server drafts with what its own verification forwards already computed.

Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", arXiv 2408.08696, section 3): every forward gives the
target's logits at every input position, accepted or not, and their top-k is thrown away. Kept
in an adjacency table token -> the target's top-k successors the last time that token was an
input (`recycle`), it drafts a tree by expanding, from the last committed token, each node into
the table's successors of its token. It needs no model and no training, and costs the server a
top-k over the rows it computed anyway (the session computes it: Session.watch_successors).

Taken from the paper: the table of top-k successors, overwritten by every forward's rows, and
the tree grown by repeated look-ups. This implementation's own choices:
  - the tree is grown best-first (EAGLE-2's rule, docs/architecture.md, Drafters) with a node's
    score the product over its path of the measured rate at which a successor of that rank was
    accepted, sized by the server's tree budget, instead of the paper's fixed tree template;
  - a token the target has not seen as an input yet falls back on the tokens that followed it
    in the committed text, most recent first (the paper starts from an empty or a previous
    query's table: a table shared across sessions would carry one user's text into another's
    drafts, so each session starts afresh);
  - as MoA's trees do, a prompt-lookup tree (shared/drafting/pld.py) of up to a quarter of the
    budget is merged in where the text repeats itself: a table keyed by one token cannot copy
    a long span, and n-gram lookup can.
Only the server can run it: the edge never sees the target's logits.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.drafting.base import DrafterName, TextDrafter
from shared.drafting.pld import LOOKUP_NODES, PromptLookupDrafter, with_lookup
from shared.drafting.trie import TokenTrie
from shared.tree import ROOT, DraftTree

TOP_K = 8  # successors kept per token (the paper's k)
MAX_DEPTH = 8  # the deepest tree it grows, unless the server's limit is lower
NOT_A_SUCCESSOR = -1
PRIOR_WEIGHT = 2.0  # pseudo-trials behind each rank's prior acceptance rate


class RecyclingDrafter(TextDrafter):
    name = DrafterName.RECYCLE
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS

    def __init__(self, max_depth: int = MAX_DEPTH, top_k: int = TOP_K,
                 lookup_nodes: int = LOOKUP_NODES) -> None:
        self.max_depth = max_depth
        self.top_k = top_k
        self.lookup_nodes = lookup_nodes
        self._lookup = PromptLookupDrafter(max_depth=max_depth)
        self._prior = 0.5 / (1.0 + np.arange(top_k))  # [top_k]: rank r is right this often
        self.reset(())

    def reset(self, prompt: Sequence[int]) -> None:
        self._recycled: dict[int, tuple[int, ...]] = {}  # token -> the target's top-k successors
        self._followers: dict[int, list[int]] = {}  # token -> what followed it in the text
        self._indexed = 0
        self._offered = np.zeros(self.top_k)  # successors of rank r offered where checkable
        self._hits = np.zeros(self.top_k)  # ... and accepted
        self._last: tuple[DraftTree, tuple[int, ...]] | None = None  # last tree, node ranks
        self._lookup.reset(prompt)
        self._index(prompt)

    def recycle(self, inputs: Sequence[int], successors: np.ndarray) -> None:
        """A forward's inputs and the target's top-k at each: successors [len(inputs), k],
        best first. Later rows overwrite earlier ones, as the paper's table does."""
        rows = successors[:, : self.top_k].tolist()  # one conversion for the forward's rows
        self._recycled.update(zip(map(int, inputs), map(tuple, rows)))

    def successors(self, token: int) -> Sequence[int]:
        """The candidates after `token`, best first."""
        recycled = self._recycled.get(token)
        return recycled if recycled is not None else self._followers.get(token, ())

    def rank_rates(self) -> np.ndarray:
        """[top_k]: the rate at which a successor of each rank was accepted."""
        return ((self._hits + PRIOR_WEIGHT * self._prior)
                / (self._offered + PRIOR_WEIGHT))

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        tree = with_lookup(self._lookup, context, max_nodes, self.lookup_nodes,
                           lambda room: self._grown(context, room).tree())
        self._last = (tree, self._ranks(tree, context[-1] if context else None))
        return tree

    def propose_sampled(self, context: Sequence[int], max_nodes: int,
                        rng: np.random.Generator) -> Proposal:
        """Drafts drawn from q = each node's successors weighted by their rank's rate."""
        trie = TokenTrie()
        grown = self._grown(context, max_nodes)
        for token, parent, score in zip(grown.tokens, grown.parents, grown.scores):
            trie.add(parent, token, score)
        return trie.sampled_tree(max_nodes, rng)

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Counts, per rank, the successors offered below an accepted node (or the root) and
        those accepted: the rates that order the next trees."""
        if self._last is None or self._last[0] != tree:
            return
        ranks = self._last[1]
        reached = {ROOT, *accepted_nodes}
        for node, parent in enumerate(tree.parents):
            if parent in reached and ranks[node] != NOT_A_SUCCESSOR:
                self._offered[ranks[node]] += 1
                self._hits[ranks[node]] += node in reached

    def _grown(self, context: Sequence[int], max_nodes: int) -> "_Grown":
        """The best `max_nodes` nodes grown from the last committed token, best first: a node's
        score is its parent's times the rate of its rank, ties to the earlier expanded parent,
        then the lower rank (the order of a heap holding every node's whole successor list).

        Rates are at most 1, so a parent's successors come out of the heap in the order of
        their own scores, and the heap need hold only each expanded node's best successor not
        yet taken: a taken successor puts its next sibling in. That pops the same nodes in the
        same order with at most two pushes a node instead of top_k (the heap pushes were a
        third of server-side speculation's Python at 16 sessions, host_paced_profile): 2.2x
        to 2.7x faster for 16 to 128 nodes. A token's successors are distinct (a top-k, or
        the text's followers without repeats), so no two grown nodes are one trie node."""
        self._index(context)
        rates = self.rank_rates().tolist()
        monotone = all(a >= b for a, b in zip(rates, rates[1:]))
        grown = _Grown()
        # (-score, expansion, rank, place in the sibling order, siblings)
        heap: list[tuple[float, int, int, int, _Siblings]] = []

        def expand(parent: int, token: int, score: float, depth: int) -> None:
            successors = self.successors(token) if depth < self.max_depth else ()
            if not successors:
                return
            order = (range(len(successors)) if monotone
                     else sorted(range(len(successors)), key=lambda r: (-score * rates[r], r)))
            siblings = _Siblings(parent, depth + 1, successors, score, order, len(grown))
            first = order[0]
            heapq.heappush(heap, (-score * rates[first], siblings.expansion, first, 0, siblings))

        if context:
            expand(ROOT, context[-1], 1.0, 0)
        while heap and len(grown) < max_nodes:
            neg, expansion, rank, place, siblings = heapq.heappop(heap)
            if place + 1 < len(siblings.order):
                nxt = siblings.order[place + 1]
                heapq.heappush(heap, (-siblings.score * rates[nxt], expansion, nxt, place + 1,
                                      siblings))
            token = int(siblings.successors[rank])
            expand(grown.add(siblings.parent, token, -neg), token, -neg, siblings.depth)
        return grown

    def _ranks(self, tree: DraftTree, last: int | None) -> tuple[int, ...]:
        """Each node's rank among its parent token's successors, as the table has them now
        (NOT_A_SUCCESSOR for a lookup node the table does not have)."""
        ranks = []
        for parent, token in zip(tree.parents, tree.tokens):
            above = last if parent == ROOT else tree.tokens[parent]
            successors = () if above is None else self.successors(above)
            ranks.append(successors.index(token) if token in successors else NOT_A_SUCCESSOR)
        return tuple(ranks)

    def _index(self, text: Sequence[int]) -> None:
        """Records what followed each token of `text` not indexed yet; a shorter text than
        the one indexed is another text, whose followers start afresh."""
        if len(text) < self._indexed:
            self._followers, self._indexed = {}, 0
        for i in range(max(1, self._indexed), len(text)):
            followers = self._followers.setdefault(text[i - 1], [])
            if text[i] in followers:
                followers.remove(text[i])
            followers.insert(0, text[i])
            del followers[self.top_k:]
        self._indexed = len(text)


class _Siblings(NamedTuple):
    """The successors of one expanded node, in the order their scores put them (a tuple: one
    is made for each node grown)."""

    parent: int  # the node they hang under (ROOT: the committed text)
    depth: int  # theirs, 1 for the first level
    successors: Sequence[int]
    score: float  # their parent's; a successor of rank r scores score * rates[r]
    order: Sequence[int]  # ranks, best score first, ties to the lower rank
    expansion: int  # how many nodes were grown before their parent was expanded


class _Grown:
    """The grown nodes in the order they were taken: parents before children, best first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        return len(self.tokens) - 1

    def tree(self) -> DraftTree:
        return DraftTree(tuple(self.tokens), tuple(self.parents))
