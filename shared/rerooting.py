"""A client's draft re-rooted at the server's committed position (server-paced sessions).

A draft continues the committed text as it was when the client drafted it (`base_length`). The
server does not wait for it: by the time it arrives the server may have committed more tokens.
The draft still helps if its tree predicted them: walk it from its first level along those
tokens, and the nodes below the last match are a draft for the new position. A draft that took
another path contributes nothing. Both sides call this function, so a Verdict names accepted
nodes by their index in the re-rooted tree and the client maps them back without a table.

Re-rooting keeps every acceptance rule lossless: the subtree's tokens (and, for sampled drafts,
the q they were drawn from) were fixed before the server drew anything at those positions, which
is all the rules of docs/architecture.md ask of a draft.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shared.draft_q import NodeQ, Proposal
from shared.tree import ROOT, DraftTree


@dataclass(frozen=True)
class Rerooted:
    proposal: Proposal  # continues the committed text at its new length; q re-indexed to it
    nodes: tuple[int, ...]  # nodes[i]: the index in the original draft of the tree's node i


def reroot(tree: DraftTree, base_length: int, committed: Sequence[int],
           q: tuple[NodeQ, ...] = ()) -> Rerooted | None:
    """The part of `tree` (drafted at `base_length`) that continues `committed`; None when the
    tree does not follow the tokens committed since its base, or nothing of it is left."""
    if base_length > len(committed):
        raise ValueError(f"draft base {base_length} is past the committed {len(committed)}")
    since = committed[base_length:]
    path = tree.walk(since)
    if len(path) < len(since):
        return None
    anchor = path[-1] if path else ROOT
    sub, nodes = tree.subtree_nodes(anchor)
    if not len(sub):
        return None
    index = {anchor: ROOT, **{old: new for new, old in enumerate(nodes)}}
    kept_q = tuple(NodeQ(index[row.node], row.tokens, row.probs) for row in q
                   if row.node in index)
    return Rerooted(Proposal(sub, kept_q), nodes)

