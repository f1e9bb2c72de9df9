"""The Mixture-of-Attentions drafter on the edge: its network (moa_graphs.py) run one token a
step.

Zimmer et al., arXiv 2410.03804, split per docs/architecture.md, Drafters: from the memory of
verified positions and the Self-Attention K/V of the committed text it drafts autoregressively,
so it can draft past the last verified position. A round's nodes each run as one query under
the tree mask (the text and the node's ancestors). A recurrent bundle (cloud_server/moa/README.md)
also feeds each position the previous one's feature: verified where the server sent it, else
the drafter's own. Its trees are tree_drafter.py's. Numpy and onnxruntime only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edge_client.drafters.draft_trees import Candidates, Expand, common_prefix
from edge_client.drafters.tree_drafter import TreeDrafter
from shared.drafting.base import DrafterName
from shared.tree import ROOT


class MoaDrafter(TreeDrafter):
    name = DrafterName.MOA

    def reset(self, prompt: Sequence[int]) -> None:
        super().reset(prompt)
        # recurrent: each cached position's own feature, and how many leading cached positions
        # read verified ones
        self._own = np.zeros((0, self.graphs.width), dtype=np.float32)  # [cached, width]
        self._exact = 0

    def add_activations(self, start: int, activations: np.ndarray) -> None:
        self.graphs.add_activations(start, activations)
        if self.graphs.recurrent:
            self._exact = min(self._exact, start + 1)

    def _sync(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Brings the SA cache to `context` and returns the top children of its last token.

        Keeps the longest common prefix (a rewind drops the rest) but always re-runs at least
        the last token, whose outputs are the first level of the tree. A recurrent drafter also
        re-runs the positions it computed from its own features where verified ones have come
        since, and runs positions past the verified ones one at a time, each reading the
        previous one's own feature."""
        graphs = self.graphs
        keep = common_prefix(graphs.context, context[:-1])
        if graphs.recurrent and self._exact < min(keep, graphs.verified + 1):
            keep = self._exact
        graphs.keep(keep)
        self._own = self._own[:keep]
        self._exact = min(self._exact, keep)
        together = len(context) if not graphs.recurrent else max(keep + 1, min(
            len(context), graphs.verified + 1))
        top = self._extend(context[keep:together])
        for token in context[together:]:
            top = self._extend([token])
        return top

    def _extend(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Runs `tokens` after the cached context in one step; the last one's top children."""
        graphs = self.graphs
        start = len(graphs.context)
        new = np.asarray(tokens, dtype=np.int64)  # [q]
        allowed = np.tril(np.ones((len(new), start + len(new)), dtype=bool), k=start)
        outputs = graphs.step(new, np.arange(start, start + len(new), dtype=np.int64), allowed,
                              features=self._context_features(start, len(new)))
        _, top_logprobs, top_ids, keys, values = outputs[:5]
        graphs.append(tokens, keys, values)
        if graphs.recurrent:
            self._own = np.concatenate((self._own, outputs[5]))
            if self._exact == start:
                self._exact = min(len(graphs.context), graphs.verified + 1)
        return top_logprobs[-1], top_ids[-1]

    def _context_features(self, start: int, count: int) -> np.ndarray | None:
        """The previous positions' features of context positions start .. start + count - 1:
        verified where there are, else this drafter's own (already in `_own`); None when the
        drafter is not recurrent."""
        if not self.graphs.recurrent:
            return None
        verified_count = self.graphs.verified
        positions = np.arange(start, start + count)
        verified = (positions > 0) & (positions <= verified_count)
        own = positions > verified_count
        rows = np.zeros((count, self.graphs.width), dtype=np.float32)  # position 0: no previous
        rows[verified] = self.graphs.rows[positions[verified] - 1]
        rows[own] = self._own[positions[own] - 1]
        return rows

    def _expander(self, context: Sequence[int]) -> Expand:
        """One round's `Expand`: it keeps the round's K/V ([state_heads, slots, hd]), a recurrent
        drafter's own features ([slots, width]) and each expanded node's row in them."""
        keys, values = self.graphs.empty(), self.graphs.empty()
        features = np.zeros((0, self.graphs.width), dtype=np.float32)

        def expand(nodes: Candidates, frontier: list[int]) -> tuple[np.ndarray, np.ndarray]:
            nonlocal keys, values, features
            parents = None if not self.graphs.recurrent else np.asarray(
                [self._own[-1] if nodes.parents[node] == ROOT
                 else features[nodes.slots[nodes.parents[node]]] for node in frontier])
            outputs = self._step_frontier(context, nodes, frontier, (keys, values), parents)
            top_logprobs, top_ids, new_keys, new_values = outputs[:4]
            for row, node in enumerate(frontier):
                nodes.slots[node] = keys.shape[1] + row
            keys = np.concatenate((keys, new_keys), axis=1)
            values = np.concatenate((values, new_values), axis=1)
            if self.graphs.recurrent:
                features = np.concatenate((features, outputs[4]))
            return top_logprobs, top_ids

        return expand

    def _step_frontier(self, context: Sequence[int], nodes: Candidates, frontier: list[int],
                       tree: tuple[np.ndarray, np.ndarray],
                       features: np.ndarray | None) -> list[np.ndarray]:
        """One step over the frontier nodes under the tree mask, after the round's K/V `tree`:
        their top children, K/V and (recurrent) own features."""
        base, slots, q = len(context), tree[0].shape[1], len(frontier)
        allowed = np.zeros((q, base + slots + q), dtype=bool)  # [q, base + slots + q]
        allowed[:, :base] = True
        for row, node in enumerate(frontier):
            allowed[row, [base + nodes.slots[a] for a in nodes.ancestors(node)]] = True
            allowed[row, base + slots + row] = True
        return self.graphs.step(
            np.array([nodes.tokens[i] for i in frontier], dtype=np.int64),
            np.array([base + nodes.depths[i] for i in frontier], dtype=np.int64),
            allowed, tree, features)[1:]
