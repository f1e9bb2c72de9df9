"""Falcon's semi-autoregressive drafter on the edge (Gao et al., AAAI 2025, arXiv 2412.12639).

The bundle is the MoA drafter's (same graphs, same activations), trained with `block` = k > 1
(cloud_server/training/sar.py): k tokens that see each other give, in one step, the k tokens
that follow them. A round's first step runs the text's last k tokens as a block: its rows
score the tokens at depths 1 .. k. A node at depth d draws its children from the next row of
the step that drafted it (siblings share those rows, as in the paper's decoding tree, section
3.3) and only a node that ends a block (depth k, 2k, ...) needs a new step: the k nodes on its
path down from the last block end go in as one block, under the tree mask (the prefix, their
ancestors, and each other). So a tree of depth D costs D / k steps instead of D.

The trees are the MoA drafter's (tree_drafter.py): the EAGLE-2 dynamic tree over cumulative
log q, prompt lookup nodes, graph merging and sampled trees all work unchanged, since only how
a node's children are scored differs, and one thing Falcon's tree does: inside a block, where
children cost no step, every node that could still make the cut is expanded, not only the best
`beam`.
Falcon's own Custom-Designed Decoding Tree is a static shape (`choices=`, static_trees.py),
designed from this drafter's measured ranks rather than tuned by hand for Vicuna; it tied with
the dynamic tree (results log, `drafter_ablation_cddt`), which stays the default
(`edge-client --tree designed` drafts the design the bundle carries).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from edge_client.drafters.draft_trees import Candidates, Expand, common_prefix
from edge_client.drafters.tree_drafter import TreeDrafter
from shared.drafting.base import DrafterName
from shared.tree import ROOT


class FalconDrafter(TreeDrafter):
    name = DrafterName.FALCON

    def _ready(self, context: Sequence[int]) -> bool:
        """A first block needs `block` tokens of text."""
        return len(context) >= self.graphs.block and super()._ready(context)

    def _beam_at(self, depth: int) -> int:
        """Inside a block, children come from rows already computed: every node that could
        still make the cut is expanded, as Falcon's tree takes several tokens from one pass;
        a node that ends a block costs queries in the next step, so only the best `beam` do."""
        return self.search.beam if (depth + 1) % self.graphs.block == 0 else sys.maxsize

    def _sync(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Brings the SA cache to `context`, running at least its last `block` tokens, which see
        each other; keeps their rows (top log q and ids, [block, top_k] each) for the round's
        expander and returns the first, the tree's first level."""
        graphs, block = self.graphs, self.graphs.block
        start = common_prefix(graphs.context, context[:-block])
        graphs.keep(start)
        new = np.asarray(context[start:], dtype=np.int64)  # [q]
        allowed = np.tril(np.ones((len(new), start + len(new)), dtype=bool), k=start)
        allowed[-block:] = True  # the last block sees all of it
        _, top_logprobs, top_ids, keys, values = graphs.step(
            new, np.arange(start, start + len(new), dtype=np.int64), allowed)
        graphs.append(context[start:], keys, values)
        self._first_rows = (top_logprobs[-block:], top_ids[-block:])
        return top_logprobs[-block], top_ids[-block]

    def _expander(self, context: Sequence[int]) -> Expand:
        """One round's `Expand`: the steps run so far (their rows), where each expanded node's
        children come from (step, row), and the round's K/V of the nodes run in blocks."""
        steps = [self._first_rows]  # per step: top log q, ids: [block, top_k]
        source: dict[int, tuple[int, int]] = {ROOT: (0, 0)}  # node -> its children's row
        keys, values = self.graphs.empty(), self.graphs.empty()
        block = self.graphs.block

        def expand(nodes: Candidates, frontier: list[int]) -> tuple[np.ndarray, np.ndarray]:
            nonlocal keys, values
            ends = []  # frontier nodes that end a block: their children need a step
            for node in frontier:
                step, row = source[nodes.parents[node]]
                if row + 1 < block:
                    source[node] = (step, row + 1)
                else:
                    ends.append(node)
            if ends:
                top_logprobs, top_ids, new_keys, new_values = self._step_blocks(
                    context, nodes, ends, (keys, values))
                for i, node in enumerate(ends):
                    rows = slice(i * block, (i + 1) * block)
                    steps.append((top_logprobs[rows], top_ids[rows]))
                    source[node] = (len(steps) - 1, 0)
                keys = np.concatenate((keys, new_keys), axis=1)
                values = np.concatenate((values, new_values), axis=1)
            found = [(steps[source[node][0]], source[node][1]) for node in frontier]
            return (np.stack([logprobs[row] for (logprobs, _), row in found]),
                    np.stack([ids[row] for (_, ids), row in found]))

        return expand

    def _block_of(self, nodes: Candidates, end: int) -> list[int]:
        """The `block` nodes on the path down to `end`, a block end, top first."""
        return [*reversed(nodes.ancestors(end)[:self.graphs.block - 1]), end]

    def _step_blocks(self, context: Sequence[int], nodes: Candidates, ends: list[int],
                     tree: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
        """One step over the blocks ending at `ends`, after the round's K/V `tree`: each
        block's nodes see the text, the nodes above the block and each other. Returns top log
        q, ids, K, V of every query ([len(ends) * block] rows) and gives the queries their
        slots in the round's K/V."""
        base, slots, size = len(context), tree[0].shape[1], self.graphs.block
        blocks = [self._block_of(nodes, end) for end in ends]
        queries = [node for block in blocks for node in block]
        allowed = np.zeros((len(queries), base + slots + len(queries)), dtype=bool)
        allowed[:, :base] = True
        for i, block in enumerate(blocks):
            rows = slice(i * size, (i + 1) * size)
            above = [base + nodes.slots[a] for a in nodes.ancestors(block[0])]
            allowed[rows, above] = True
            allowed[rows, base + slots + i * size:base + slots + (i + 1) * size] = True
        for i, node in enumerate(queries):
            nodes.slots[node] = slots + i
        return self.graphs.step(
            np.array([nodes.tokens[i] for i in queries], dtype=np.int64),
            np.array([base + nodes.depths[i] for i in queries], dtype=np.int64),
            allowed, tree)[1:]
