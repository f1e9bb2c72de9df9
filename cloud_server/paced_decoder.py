"""What one server-paced forward verifies: the client's freshest draft, re-rooted at the
committed position, merged with the server's own candidates (docs/architecture.md, "Pacing").

The client's nodes come first in the merged tree, so the Verdict can name the accepted ones by
their index in the re-rooted draft. Under acceptance sampled-drafts a tree must carry the q its
children were drawn from, and a merge of two drafters' draws has none: the client's draft is
then verified alone, and the server's own drawn tree only when no client draft fits. Runs on
the model thread; knows nothing of gRPC.
"""
from __future__ import annotations

import time
from dataclasses import replace

from cloud_server.server_decoding import ServerDecoder
from cloud_server.session import Session
from cloud_server.target import Work
from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.drafting.budget import TreeBudget
from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot


class PacedDecoder:
    def __init__(self, session: Session, own: ServerDecoder,
                 verify_costs: tuple[tuple[int, float], ...]):
        self.session = session
        self.own = own
        # Sizes the merged tree: a stale client draft's nodes cost verify time whether or not
        # they are accepted, and on a CPU server a tree costs clearly more than one token.
        self._budget = TreeBudget(verify_costs, session.limits.max_tree_nodes)

    def stepping(self, draft: DraftRequest | None, queued_at: float, epoch: int
                 ) -> Work[Verdict | None]:
        """One forward; None, and no forward, when a resume took the session over after this
        work was handed in under `epoch` (the check runs on the model thread, in the same call
        as the forward, so a catch-up never misses what it commits)."""
        if self.session.epoch != epoch:
            return None
        start = time.perf_counter()
        context = list(self.session.committed)
        client = (None if draft is None
                  else reroot(draft.tree, draft.base_length, context, draft.q))
        if draft is None or client is None:
            own = self.own.propose(context)
            # The Verdict names the client's accepted nodes only (none here): the edge counts
            # what its drafts earned from it. The server's drafter learns from its own path.
            verdict = yield from self.session.advancing(own, queued_at, client_nodes=0)
            mine = replace(verdict, accepted_nodes=tuple(own.tree.walk(verdict.tokens[:-1])))
            self.own.learn(context, own.tree, mine, start)
            return verdict
        tree = client.proposal.tree
        if self.session.acceptance is not AcceptanceMode.SAMPLED_DRAFTS:
            # Any tree is lossless under these rules; a sampled one must stay as drawn.
            tree = tree.merged(self.own.propose(context).tree, self.session.limits.max_tree_nodes)
            tree = tree.prefix(self._budget.nodes(self.own.load()))
        verdict = yield from self.session.advancing(
            Proposal(tree, client.proposal.q), queued_at, draft.round_id,
            min(len(client.proposal.tree), len(tree)))
        self._budget.observe(len(tree), tree.walk(verdict.tokens[:-1]), verdict.verify_ms,
                             verdict.verify_ms)
        return verdict
