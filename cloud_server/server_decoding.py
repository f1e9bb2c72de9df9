"""Generation on the server alone: the baselines split decoding is measured against (DESIGN 7).

Either plain decoding, one target forward per token (a plain streaming API), or speculative
decoding with a training-free drafter that runs on the server next to the target, its trees sized
by the same cost model the edge uses. Runs on the model thread; knows nothing of gRPC.
"""
from __future__ import annotations

import time

from cloud_server.session import Session
from shared.drafting.budget import TreeBudget
from shared.drafting import DRAFTERS, make_drafter
from shared.acceptance import AcceptanceMode
from shared.draft_q import NodeQ
from shared.errors import InvalidRequest
from shared.messages import Verdict
from shared.sampling import RngStream, round_rng
from shared.tree import DraftTree

PLAIN = DraftTree((), ())


class ServerDecoder:
    def __init__(self, session: Session, drafter: str | None, tree_nodes: int,
                 verify_costs: tuple[tuple[int, float], ...]):
        if drafter is not None and drafter not in DRAFTERS:
            raise InvalidRequest(f"unknown drafter {drafter!r}; the server runs: "
                                 f"{', '.join(sorted(DRAFTERS))}")
        limits = session.limits
        if tree_nodes > limits.max_tree_nodes:
            raise InvalidRequest(f"tree_nodes {tree_nodes} is over the server's limit "
                                 f"{limits.max_tree_nodes}")
        self.session = session
        self._drafter = None if drafter is None else make_drafter(drafter, limits.max_tree_depth)
        self._budget = TreeBudget(verify_costs, limits.max_tree_nodes, fixed=tree_nodes or None)
        if self._drafter is not None:
            self._drafter.reset(session.committed)

    def step(self) -> Verdict:
        """One target forward: a plain decoding step, or one drafted tree verified."""
        start = time.perf_counter()
        context = list(self.session.committed)
        tree, q = self.propose(context)
        verdict = self.session.advance(tree, q)
        self.learn(context, tree, verdict, start)
        return verdict

    def propose(self, context: list[int]) -> tuple[DraftTree, tuple[NodeQ, ...]]:
        """The server's own candidates continuing `context` (empty without a drafter)."""
        if self._drafter is None:
            return PLAIN, ()
        nodes = self._budget.nodes()
        if self.session.acceptance is not AcceptanceMode.SAMPLED_DRAFTS:
            return self._drafter.propose(context, nodes), ()
        rng = round_rng(self.session.seed, RngStream.DRAFT, len(context))
        return self._drafter.propose_sampled(context, nodes, rng)

    def learn(self, context: list[int], tree: DraftTree, verdict: Verdict, start: float) -> None:
        """Feeds a forward's outcome for `tree` (proposed at `context`, from perf_counter
        `start`) to the drafter and the tree budget."""
        if self._drafter is None:
            return
        self._drafter.observe(context, tree, verdict.accepted_nodes, verdict.tokens)
        self._budget.observe(len(tree), verdict.accepted_nodes,
                             1000 * (time.perf_counter() - start), verdict.verify_ms)
