"""What one forward of the decode loop (decode_loop.py) verifies: the client's freshest draft,
re-rooted at the committed position (a no-op where it continues the committed text, as every
lock-step draft does), merged with the server's own candidates and cut to the tree budget
(docs/architecture.md, "Pacing"). Without a client draft it is the server's own step; without
candidates of its own (lock-step) the client's draft is verified as sent.

Whose nodes come first in the merged tree, and so survive the tree budget, is learned per
session (`Precedence`); the Verdict names the client's accepted nodes by their index in the
re-rooted draft either way. Under acceptance sampled-drafts a tree must carry the q its
children were drawn from, and a merge of two drafters' draws has none: the client's draft is
then verified alone, and the server's own drawn tree only when no client draft fits. Runs on
the model thread; knows nothing of gRPC.
"""
from __future__ import annotations

from dataclasses import replace

from cloud_server.decoding.decode_loop import Forwarded
from cloud_server.decoding.server_decoding import ServerDecoder
from cloud_server.decoding.session import Session
from cloud_server.engine.interface import Work
from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal
from shared.drafting.budget import TreeBudget
from shared.messages import DraftRequest
from shared.moving_average import ema
from shared.rerooting import reroot


class ForwardBuilder:
    """Builds and runs a session's forwards. `names_own`: the Verdict names the server's own
    accepted nodes when it verified no client draft (server-side generation); else it names
    the client's only, so the edge counts what its drafts earned."""

    def __init__(self, session: Session, own: ServerDecoder,
                 verify_costs: tuple[tuple[int, float], ...], names_own: bool = False):
        self.session = session
        self.own = own
        self.names_own = names_own
        self.epoch = session.epoch  # a resume after this takes the session over
        # Sizes the merged tree: a stale client draft's nodes cost verify time whether or not
        # they are accepted, and on a CPU server a tree costs clearly more than one token.
        self._budget = TreeBudget(verify_costs, session.spec.limits.max_tree_nodes)
        self._precedence = Precedence()

    def draft_nodes(self) -> int:
        """The most nodes of a client draft the next forward verifies (Verdict.draft_nodes): in
        a merged forward the budget cuts what goes past it."""
        return self._budget.nodes(self.own.load())

    def stepping(self, draft: DraftRequest | None, queued_at: float
                 ) -> Work[Forwarded | None]:
        """One forward; None, and no forward, when a resume took the session over after this
        builder was made (the check runs on the model thread, in the same call as the
        forward, so a catch-up never misses what it commits)."""
        if self.session.epoch != self.epoch:
            return None
        context = list(self.session.committed)
        client = (None if draft is None
                  else reroot(draft.tree, draft.base_length, context, draft.q))
        if draft is None or client is None:
            verdict = yield from self.own.stepping(queued_at)
            if not self.names_own:
                verdict = replace(verdict, accepted_nodes=())
            return Forwarded(verdict, len(verdict.tokens))
        if not self.own.drafts or self.session.spec.acceptance is AcceptanceMode.SAMPLED_DRAFTS:
            # Any tree is lossless under the other rules; a sampled one must stay as drawn.
            verdict = yield from self.session.advancing(client.proposal, queued_at,
                                                        draft.round_id)
            return Forwarded(verdict, None)
        # The merged tree keeps `nodes` at most: the server's own need not draft more
        nodes = self._budget.nodes(self.own.load())
        client_tree, own_tree = client.proposal.tree, self.own.propose(context, nodes).tree
        first, second = ((own_tree, client_tree) if self._precedence.own_first()
                         else (client_tree, own_tree))
        tree = first.merged(second, self.session.spec.limits.max_tree_nodes).prefix(nodes)
        verdict = yield from self.session.advancing(Proposal(tree), queued_at, draft.round_id,
                                                    names_nodes=False)
        said = verdict.tokens[:-1]
        self._budget.observe(len(tree), tree.walk(said), verdict.verify_ms, verdict.verify_ms,
                             self.own.last_draft_ms)
        # The target's tokens are what they are: either tree alone would have had accepted as
        # much of them as it follows (and the forward's own token after that). What the
        # client's follows are its accepted nodes, wherever the merge put them.
        client_path, own_path = client_tree.walk(said), own_tree.walk(said)
        self._precedence.observe(len(client_path), len(own_path))
        return Forwarded(replace(verdict, accepted_nodes=tuple(client_path)), len(own_path) + 1)


class Precedence:
    """Whose nodes go first in a merged tree, the client's or the server's own: the nodes that
    go second are the ones the tree budget cuts. By default the client's, so a draft the edge
    spent its time on is verified whole; once the server's own trees follow more of the
    committed text in the same forwards, the server's: drafts wrong from their first node
    would otherwise take the budget from the server's candidates (results log,
    `latency_paired`). The comparison favours the order in use:
    the committed tokens end where the verified tree ends, and the budget cuts the tree that
    goes second, so that tree can at best tie, and a tie keeps the order."""

    def __init__(self, memory: float = 0.8):
        self._weight = 1 - memory  # of each forward in the running means
        self._client = 0.0  # running means of the tokens each tree alone follows
        self._own = 0.0

    def own_first(self) -> bool:
        return self._own > self._client

    def observe(self, client: int, own: int) -> None:
        """In a forward that merged both: how far each tree followed the committed tokens."""
        self._client = ema(self._client, client, self._weight)
        self._own = ema(self._own, own, self._weight)
