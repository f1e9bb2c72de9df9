"""The Mixture-of-Attentions drafter on the edge: the exported edge half run with onnxruntime.

Zimmer et al., arXiv 2410.03804, split per docs/architecture.md, Drafters: the server sends the activations of
verified positions (`add_activations`); this side keeps the Cross-Attention K/V of that memory
and the Self-Attention K/V of the committed text, and drafts autoregressively from them, so it
can draft past the last verified position.

A bundle whose memory is the tokens' embeddings (the paper's Independent baseline, trained
alongside) needs no activations: it feeds its memory from the committed text itself, up to the
same verified boundary.

Trees are EAGLE-2 dynamic trees (Li et al., arXiv 2406.16858, section 4): expand the `beam`
nodes of the newest depth with the highest cumulative draft log-probability, each proposing its
top `branch` children, then keep the best `max_nodes` overall, best first. With `merge`, nodes
of one depth with the same token are drafted once (GSD's draft graph, shared/draft_graph.py) and the
tree, breadth first, repeats the subtree under each; the wire sends it once. With
`lookup_nodes`, a prompt-lookup tree (pld.py) of up to that many nodes, a quarter of the budget
at most, is merged in when the text repeats itself: copying is what a small drafter predicts
worst and n-gram lookup best (REST, He et al., arXiv 2311.08252, makes the same case for
retrieval). With `race_aware`, under exponential-race, a node's children are ranked by how
likely the session's race picks each, from log q and the race's noise, weighed as the session's
committed text says (shared/drafting/race.py). A bundle trained
with `block` > 1 is Falcon's and drafts with FalconDrafter (falcon.py), which reuses all of this
but how a node's children are scored. Knows nothing of the link or the wire; numpy and
onnxruntime only.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import numpy as np

from edge_client.drafters.draft_trees import (
    Candidates, Expand, best_graph, best_tree, common_prefix, sampled_tree,
)
from edge_client.drafters.moa_bundle import load_manifest
from edge_client.drafters.static_trees import Choice, static_tree
from shared.drafting.pld import PromptLookupDrafter
from shared.acceptance import AcceptanceMode
from shared.drafter_bundle import BundleError, Graph, Memory, MemoryIO, Precision, StepIO
from shared.drafting.base import DrafterName
from shared.drafting.race import Race, RaceRanker
from shared.draft_q import Proposal
from shared.draft_graph import breadth_first
from shared.tree import ROOT, DraftTree

LOOKUP_NODES = 16  # prompt-lookup nodes merged into each tree (benchmarks/moa_tau.py)


class MoaDrafter:
    name = DrafterName.MOA
    # The rule it drafts best for under sampling, measured (results log, `sampling`).
    sampling_acceptance = AcceptanceMode.TOPK_DRAFTS
    semi_autoregressive = False  # bundles with config "block" > 1 are FalconDrafter's

    def __init__(self, bundle_dir: Path, precision: Precision = Precision.INT8, max_depth: int = 8,
                 beam: int = 8, branch: int = 8, threads: int = 1,
                 lookup_nodes: int = LOOKUP_NODES, merge: bool = False,
                 race_aware: bool = False, choices: Sequence[Choice] | None = None) -> None:
        """`choices`: a static tree's shape (static_trees.py); None: EAGLE-2's dynamic tree."""
        import onnxruntime as ort

        manifest = load_manifest(bundle_dir)
        if (manifest.block > 1) != self.semi_autoregressive:
            kind = DrafterName.FALCON if manifest.block > 1 else DrafterName.MOA
            raise BundleError(f"this drafter bundle is a {kind} drafter ({manifest.block} "
                              f"token(s) a step): draft with --drafter {kind}")
        self.block = manifest.block
        config = manifest.config
        self.kv_heads, self.head_dim = config["kv_heads"], config["head_dim"]
        # heads of the K/V state kept per position: the Self-Attention's, then each TLI layer's
        self.state_heads = manifest.state_heads
        self.width = config["width"]
        # the Independent baseline: memory rows are the verified tokens, fed by propose itself
        self.memory = manifest.memory
        self.needs_activations = self.memory is Memory.ACTIVATIONS
        self.recurrent = manifest.recurrent
        self.max_depth, self.beam = max_depth, beam
        self.top_k = manifest.top_k  # the step graph's candidates per row
        self.branch = min(branch, manifest.top_k)
        self.lookup_nodes = lookup_nodes
        self.merge = merge
        self.choices = None if choices is None else tuple(choices)
        self.step_calls = 0  # step graph runs so far (benchmarks/moa_tau.py: steps per round)
        self.race_aware = race_aware
        self._race: RaceRanker | None = None  # this session's, under exponential-race
        self.ranker: RaceRanker | None = None  # the last one: its fit carries over
        self._vocab = config["vocab_size"]
        self._lookup = PromptLookupDrafter()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self._memory, self._step = (
            ort.InferenceSession(str(bundle_dir / manifest.graph(precision, graph)), options,
                                 providers=["CPUExecutionProvider"])
            for graph in (Graph.MEMORY, Graph.STEP))
        self.reset(())

    def sibling(self) -> "MoaDrafter":
        """A drafter with state of its own (text, caches, race fit) over this one's
        onnxruntime sessions, for a generation beside this one's: the graphs' weights are
        loaded once, and onnxruntime runs one session from several threads at once."""
        twin = copy.copy(self)
        twin._lookup = PromptLookupDrafter()
        twin.step_calls = 0
        twin._race = twin.ranker = None
        twin.reset(())
        return twin

    def reset(self, prompt: Sequence[int]) -> None:
        """Forgets the text and the activation memory; activations of the prompt come next."""
        self._lookup.reset(prompt)
        self._context: list[int] = []  # committed ids whose SA K/V are in the cache
        self._sa_keys = self._empty(self.state_heads)  # [state_heads, len(_context), hd]
        self._sa_values = self._empty(self.state_heads)
        self._mem_keys = self._empty(self.kv_heads)  # [kv_heads, verified, hd]
        self._mem_values = self._empty(self.kv_heads)
        self._mem_ids: list[int] = []  # the tokens in the memory, without activations
        # recurrent: the verified activations (the features of those positions), each cached
        # position's own feature, and how many leading cached positions read verified ones
        self._rows = np.zeros((0, self.width), dtype=np.float32)  # [verified, width]
        self._own = np.zeros((0, self.width), dtype=np.float32)  # [len(_context), width]
        self._exact = 0

    def follow_race(self, race: Race | None) -> None:
        """Under exponential-race, with `race_aware`, children are ranked by how likely the
        session's race picks them (shared/drafting/race.py) instead of by log q; what the
        ranker learnt in the last session carries over at the same temperature."""
        self._race = None
        if race is not None and self.race_aware:
            self.ranker = (self.ranker.follow(race) if self.ranker is not None
                            else RaceRanker(race, self._vocab))
            self._race = self.ranker

    @property
    def verified(self) -> int:
        """How many leading positions have activations in the memory."""
        return self._mem_keys.shape[1]

    def add_activations(self, start: int, activations: np.ndarray) -> None:
        """Activations of committed positions start .. start + n - 1: [n, width], any float
        dtype. `start` below `verified` rewinds the memory there first (a resumed session)."""
        if not self.needs_activations:
            raise ValueError("this drafter reads no activations: its memory is the text's tokens")
        if start > self.verified:
            raise ValueError(f"activations start at {start}, but only {self.verified} "
                             "positions are verified: one verdict's activations are missing")
        if activations.ndim != 2 or activations.shape[1] != self.width:
            raise ValueError(f"activations must be [n, {self.width}], got {activations.shape}")
        rows = np.ascontiguousarray(activations, dtype=np.float32)
        self._remember(start, rows)
        if self.recurrent:
            self._rows = np.concatenate((self._rows[:start], rows))
            self._exact = min(self._exact, start + 1)

    def _remember(self, start: int, rows: np.ndarray) -> None:
        """Keeps memory positions < start and appends the K/V of `rows` after them."""
        keys, values = self._memory.run(None, {
            MemoryIO.rows(self.memory): rows,
            MemoryIO.POSITIONS: np.arange(start, start + len(rows), dtype=np.int64)})
        self._mem_keys = np.concatenate((self._mem_keys[:, :start], keys), axis=1)
        self._mem_values = np.concatenate((self._mem_values[:, :start], values), axis=1)

    def _run_step(self, ids: np.ndarray, positions: np.ndarray, past_keys: np.ndarray,
                  past_values: np.ndarray, allowed: np.ndarray,
                  features: np.ndarray | None) -> list[np.ndarray]:
        """The step graph (shared/drafter_bundle.py StepIO) against the current memory;
        `features` [q, width] for a recurrent drafter, else None."""
        inputs = (ids, positions, past_keys, past_values, allowed, self._mem_keys,
                  self._mem_values) + ((features,) if self.recurrent else ())
        self.step_calls += 1
        return self._step.run(None, dict(zip(StepIO.inputs(self.recurrent), inputs)))

    def _remember_tokens(self, context: Sequence[int]) -> None:
        """Self-fed memory: every committed token but the last, as activations would cover."""
        verified = list(context[:-1])
        keep = common_prefix(self._mem_ids, verified)
        if keep < len(verified) or keep < len(self._mem_ids):
            self._remember(keep, np.asarray(verified[keep:], dtype=np.int64))
            self._mem_ids = verified

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        if not context or max_nodes < 1:
            return DraftTree((), ())
        budget = min(self.lookup_nodes, max_nodes // 4)
        lookup = self._lookup.propose(context, budget) if budget else DraftTree((), ())
        tree = self._model_tree(context, max_nodes - len(lookup)).merged(lookup, max_nodes)
        return breadth_first(tree) if self.merge else tree

    def propose_sampled(self, context: Sequence[int], max_nodes: int, rng: np.random.Generator
                        ) -> Proposal:
        """Drafts drawn from q = the network's top-k distribution, renormalised
        (`sampled_tree`). No prompt-lookup nodes: they were not drawn from q."""
        if not context or max_nodes < 1 or not self._ready(context):
            return Proposal(DraftTree((), ()))
        return sampled_tree(self._sync(context), self._expander(context), max_nodes,
                            self.max_depth, self.beam, rng)

    def _ready(self, context: Sequence[int]) -> bool:
        """Brings a self-fed memory up to `context`; whether any position is verified."""
        if not self.needs_activations:
            self._remember_tokens(context)
        return self.verified > 0

    def _model_tree(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        """The network's own dynamic tree of at most `max_nodes` nodes."""
        if max_nodes < 1 or not self._ready(context):
            return DraftTree((), ())
        top_logprobs, top_ids = self._sync(context)  # [top_k] each: the first level
        if self.choices is not None:
            return static_tree((top_logprobs, top_ids), self._expander(context), self.choices,
                               max_nodes)
        if self._race is not None:
            self._race.start(context)
        nodes = Candidates()
        for score, token in self._children(top_logprobs, top_ids, nodes, ROOT):
            nodes.add(token, ROOT, score, 0)
        expand = self._expander(context)
        for depth in range(self.max_depth - 1):
            frontier = self._frontier(nodes, depth, max_nodes)
            if not frontier:
                break
            top_logprobs, top_ids = expand(nodes, frontier)
            for row, node in enumerate(frontier):
                for score, token in self._children(top_logprobs[row], top_ids[row], nodes,
                                                   node):
                    nodes.add(token, node, nodes.scores[node] + score, depth + 1)
            if self.merge:
                nodes.merge(depth + 1)
        return best_graph(nodes, max_nodes) if nodes.aliases else best_tree(nodes, max_nodes)

    def ranks_along(self, context: Sequence[int], truth: Sequence[int]) -> list[int]:
        """The rank of each token of `truth` (the target's text after `context`) among the
        drafter's top-k at its depth, down the path while it stays among them (-1 where it
        fell outside): what a static tree is designed from (static_trees.py)."""
        if not self._ready(context):
            return []
        ids = self._sync(context)[1]
        expand, nodes, ranks = self._expander(context), Candidates(), []
        for depth, token in enumerate(truth[:self.max_depth]):
            hit = np.flatnonzero(ids == token)
            ranks.append(int(hit[0]) if hit.size else -1)
            if not hit.size or depth + 1 == self.max_depth:
                break
            nodes.add(int(token), len(nodes.tokens) - 1 if depth else ROOT, 0.0, depth)
            ids = expand(nodes, [len(nodes.tokens) - 1])[1][0]
        return ranks

    def _children(self, logprobs: np.ndarray, ids: np.ndarray, nodes: Candidates,
                  parent: int) -> list[tuple[float, int]]:
        """The `branch` children (score, token) of `parent` (ROOT: the round's context) from
        its top-k: by log q, or under a race by log P(the race picks it)."""
        if self._race is None:
            return [(float(s), int(t)) for s, t in zip(logprobs[:self.branch], ids[:self.branch])]
        path = () if parent == ROOT else nodes.path(parent)
        scores = self._race.scores(logprobs, ids, path)
        best = np.argsort(-scores)[:self.branch]
        return [(float(scores[i]), int(ids[i])) for i in best]

    def observe(self, context: Sequence[int], tree: DraftTree, accepted_nodes: tuple[int, ...],
                tokens: tuple[int, ...]) -> None:
        """Nothing to learn: committed tokens reach the cache at the next propose, and their
        activations through `add_activations`."""

    def _empty(self, heads: int) -> np.ndarray:
        return np.zeros((heads, 0, self.head_dim), dtype=np.float32)

    def _sync(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Brings the SA cache to `context` and returns the top children of its last token.

        Keeps the longest common prefix (a rewind drops the rest) but always re-runs at least
        the last token, whose outputs are the first level of the tree. A recurrent drafter also
        re-runs the positions it computed from its own features where verified ones have come
        since, and runs positions past the verified ones one at a time, each reading the
        previous one's own feature."""
        keep = common_prefix(self._context, context[:-1])
        if self.recurrent and self._exact < min(keep, self.verified + 1):
            keep = self._exact
        self._context = list(context[:keep])
        self._sa_keys, self._sa_values = self._sa_keys[:, :keep], self._sa_values[:, :keep]
        self._own = self._own[:keep]
        self._exact = min(self._exact, keep)
        together = len(context) if not self.recurrent else max(keep + 1, min(
            len(context), self.verified + 1))
        top = self._extend(context[keep:together])
        for token in context[together:]:
            top = self._extend([token])
        return top

    def _extend(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Runs `tokens` after the cached context in one step; the last one's top children."""
        start = len(self._context)
        new = np.asarray(tokens, dtype=np.int64)  # [q]
        allowed = np.tril(np.ones((len(new), start + len(new)), dtype=bool), k=start)
        outputs = self._run_step(new, np.arange(start, start + len(new), dtype=np.int64),
                                 self._sa_keys, self._sa_values, allowed,
                                 self._context_features(start, len(new)))
        _, top_logprobs, top_ids, keys, values = outputs[:5]
        self._context += tokens
        self._sa_keys = np.concatenate((self._sa_keys, keys), axis=1)
        self._sa_values = np.concatenate((self._sa_values, values), axis=1)
        if self.recurrent:
            self._own = np.concatenate((self._own, outputs[5]))
            if self._exact == start:
                self._exact = min(len(self._context), self.verified + 1)
        return top_logprobs[-1], top_ids[-1]

    def _context_features(self, start: int, count: int) -> np.ndarray | None:
        """The previous positions' features of context positions start .. start + count - 1:
        verified where there are, else this drafter's own (already in `_own`); None when the
        drafter is not recurrent."""
        if not self.recurrent:
            return None
        positions = np.arange(start, start + count)
        verified = (positions > 0) & (positions <= self.verified)
        own = positions > self.verified
        rows = np.zeros((count, self.width), dtype=np.float32)  # position 0: no previous
        rows[verified] = self._rows[positions[verified] - 1]
        rows[own] = self._own[positions[own] - 1]
        return rows

    def _frontier(self, nodes: Candidates, depth: int, max_nodes: int) -> list[int]:
        """The best `beam` nodes at `depth`, if any of their children could still make the
        final cut (scores only fall along a path, so below the max_nodes-th score none can)."""
        at_depth = [i for i, d in enumerate(nodes.depths) if d == depth]
        at_depth.sort(key=lambda i: -nodes.scores[i])
        cutoff = sorted(nodes.scores, reverse=True)[min(max_nodes, len(nodes.scores)) - 1]
        return [i for i in at_depth[:self._beam_at(depth)] if i not in nodes.aliases
                and (nodes.scores[i] >= cutoff or len(nodes.scores) < max_nodes)]

    def _beam_at(self, depth: int) -> int:
        """How many nodes at `depth` (0: the first level) may be expanded."""
        return self.beam

    def _expander(self, context: Sequence[int]) -> Expand:
        """One round's `Expand`: it keeps the round's K/V ([state_heads, slots, hd]), a recurrent
        drafter's own features ([slots, width]) and each expanded node's row in them."""
        keys, values = self._empty(self.state_heads), self._empty(self.state_heads)
        features = np.zeros((0, self.width), dtype=np.float32)

        def expand(nodes: Candidates, frontier: list[int]) -> tuple[np.ndarray, np.ndarray]:
            nonlocal keys, values, features
            parents = None if not self.recurrent else np.asarray(
                [self._own[-1] if nodes.parents[node] == ROOT
                 else features[nodes.slots[nodes.parents[node]]] for node in frontier])
            outputs = self._step_frontier(context, nodes, frontier, keys, values, parents)
            top_logprobs, top_ids, new_keys, new_values = outputs[:4]
            for row, node in enumerate(frontier):
                nodes.slots[node] = keys.shape[1] + row
            keys = np.concatenate((keys, new_keys), axis=1)
            values = np.concatenate((values, new_values), axis=1)
            if self.recurrent:
                features = np.concatenate((features, outputs[4]))
            return top_logprobs, top_ids

        return expand

    def _step_frontier(self, context: Sequence[int], nodes: Candidates, frontier: list[int],
                       keys: np.ndarray, values: np.ndarray,
                       features: np.ndarray | None) -> list[np.ndarray]:
        """One step over the frontier nodes under the tree mask: their top children, K/V and
        (recurrent) own features."""
        base, slots, q = len(context), keys.shape[1], len(frontier)
        allowed = np.zeros((q, base + slots + q), dtype=bool)  # [q, base + slots + q]
        allowed[:, :base] = True
        for row, node in enumerate(frontier):
            allowed[row, [base + nodes.slots[a] for a in nodes.ancestors(node)]] = True
            allowed[row, base + slots + row] = True
        return self._run_step(
            np.array([nodes.tokens[i] for i in frontier], dtype=np.int64),
            np.array([base + nodes.depths[i] for i in frontier], dtype=np.int64),
            np.concatenate((self._sa_keys, keys), axis=1),
            np.concatenate((self._sa_values, values), axis=1), allowed, features)[1:]
