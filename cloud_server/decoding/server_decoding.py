"""Generation on the server alone: the baselines split decoding is measured against.

Either plain decoding, one target forward per token (a plain streaming API), or speculative
decoding with a training-free drafter that runs on the server next to the target, its trees sized
by the same cost model the edge uses. Runs on the model thread; knows nothing of gRPC.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from cloud_server.decoding import recycling
from cloud_server.decoding.recycling import RecyclingDrafter
from cloud_server.decoding.activation_rows import ActivationSource
from cloud_server.decoding.session import Session
from cloud_server.engine.interface import Work
from cloud_server.target import TargetModel
from shared.drafting.budget import ALONE, Load, TreeBudget
from shared.drafting import SERVER_DRAFTERS, make_drafter
from shared.drafting.base import Drafter, DrafterName, reads_activations
from shared.acceptance import AcceptanceMode
from shared.drafting.race import Race
from shared.draft_q import Proposal
from shared.errors import InvalidRequest
from shared.messages import ActivationFormat, Limits, OpenRequest, Verdict
from shared.sampling import RngStream, round_rng
from shared.tree import DraftTree

PLAIN = DraftTree((), ())


def own_drafter(name: str | None, limits: Limits) -> Drafter | None:
    """A training-free drafter the server runs itself, by the name a request gives (None:
    none); any other name is refused."""
    if name is None:
        return None
    if name not in SERVER_DRAFTERS:
        raise InvalidRequest(f"unknown drafter {name!r}; the server runs: "
                             f"{', '.join(SERVER_DRAFTERS)}")
    if name == DrafterName.RECYCLE:
        return RecyclingDrafter(max_depth=min(recycling.MAX_DEPTH, limits.max_tree_depth))
    return make_drafter(DrafterName(name), limits.max_tree_depth)


class ServerDecoder:
    """Drafts and verifies in one place: the server speculating alone (a training-free
    drafter), or any drafter in process (benchmarks: the edge's drafter fed the server half's
    activations from each Verdict, as the client feeds it)."""

    def __init__(self, session: Session, drafter: Drafter | None, tree_nodes: int,
                 verify_costs: tuple[tuple[int, float], ...],
                 load: Callable[[], Load] = lambda: ALONE):
        """`load`: what the server's last forward ran, which sizes trees under batching."""
        limits = session.spec.limits
        if tree_nodes > limits.max_tree_nodes:
            raise InvalidRequest(f"tree_nodes {tree_nodes} is over the server's limit "
                                 f"{limits.max_tree_nodes}")
        self.session = session
        self._drafter = drafter
        self._budget = TreeBudget(verify_costs, limits.max_tree_nodes, fixed=tree_nodes or None)
        self.draft_s = 0.0  # time spent proposing
        self.last_draft_ms = 0.0  # the last propose's
        self.load = load
        if isinstance(drafter, RecyclingDrafter):
            session.watch_successors(drafter.top_k, drafter.recycle)
        if self._drafter is not None:
            self._drafter.reset(session.committed)
            self._drafter.follow_race(Race.of(session.spec.acceptance, session.spec.seed,
                                              session.spec.sampling))

    def prefilling(self) -> Work[Verdict]:
        verdict = yield from self.session.prefilling()
        self._feed(verdict)
        return verdict

    @property
    def drafts(self) -> bool:
        """Whether it has candidates of its own (else each step is plain decoding)."""
        return self._drafter is not None

    def stepping(self, queued_at: float | None = None) -> Work[Verdict]:
        """One target forward: a plain decoding step, or one drafted tree verified; the
        Verdict names the accepted nodes. `queued_at`: when it started waiting for the
        model (perf_counter)."""
        start = time.perf_counter()
        context = list(self.session.committed)
        proposal = self.propose(context)
        verdict = yield from self.session.advancing(proposal, queued_at)
        self.learn(context, proposal.tree, verdict, start)
        return verdict

    def propose(self, context: list[int], nodes: int | None = None) -> Proposal:
        """The drafter's candidates continuing `context` (empty without a drafter), at most
        `nodes` of them (None: as many as its own tree budget asks)."""
        if self._drafter is None:
            return Proposal(PLAIN)
        start = time.perf_counter()
        if nodes is None:
            nodes = self._budget.nodes(self.load())
        if self.session.spec.acceptance is not AcceptanceMode.SAMPLED_DRAFTS:
            proposal = Proposal(self._drafter.propose(context, nodes))
        else:
            rng = round_rng(self.session.spec.seed, RngStream.DRAFT, len(context))
            proposal = self._drafter.propose_sampled(context, nodes, rng)
        spent = time.perf_counter() - start
        self.draft_s += spent
        self.last_draft_ms = 1000 * spent
        return proposal

    def learn(self, context: list[int], tree: DraftTree, verdict: Verdict, start: float) -> None:
        """Feeds a forward's outcome for `tree` (proposed at `context`, from perf_counter
        `start`) to the drafter and the tree budget."""
        if self._drafter is None:
            return
        self._drafter.observe(context, tree, verdict.accepted_nodes, verdict.tokens)
        round_ms = 1000 * (time.perf_counter() - start) - self.last_draft_ms
        self._budget.observe(len(tree), verdict.accepted_nodes, round_ms, verdict.verify_ms,
                             self.last_draft_ms)
        self._feed(verdict)

    def _feed(self, verdict: Verdict) -> None:
        """Hands a drafter that reads activations the rows the Verdict carries (the session
        computes them when the edge's drafter asked, whoever proposed this tree)."""
        drafter = self._drafter
        if verdict.activations is not None and reads_activations(drafter):
            drafter.add_activations(verdict.activations.start, verdict.activations.values)


@dataclass(frozen=True)
class InProcessRun:
    verdicts: tuple[Verdict, ...]  # the prefill's, then one per forward
    draft_s: float  # time the drafter spent proposing


def decode_in_process(target: TargetModel, request: OpenRequest, drafter: Drafter | None,
                      tree_nodes: int, activations: ActivationSource | None = None,
                      limits: Limits = Limits()) -> InProcessRun:
    """One generation without the network: the server's session verifying `drafter`'s trees
    (None: plain decoding), the drafter fed the server half's activations when it reads them."""
    if reads_activations(drafter):
        request = replace(request, activations=ActivationFormat.FP16)
    session = Session.open(target, limits, request, activations)
    decoder = ServerDecoder(session, drafter, tree_nodes, ())
    verdicts = [target.drive(decoder.prefilling())]
    while not session.finished:
        verdicts.append(target.drive(decoder.stepping()))
    return InProcessRun(tuple(verdicts), decoder.draft_s)
