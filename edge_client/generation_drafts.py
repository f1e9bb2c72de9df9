"""What one split generation drafts: the next tree to send (a speculation that came true, offline
text to check, or a fresh draft sized by the tree budget), what a verified tree teaches the
drafter and the budget, and the text drafted alone while the link is down.

Knows the drafter, not the stream: generate.py decides when to send and commits what the server
verified. The drafter runs where `drafting` says (None: on the event loop), so that generations
sharing a loop do not wait for each other's drafting.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Callable, Sequence, TypeVar

from edge_client.offline import LinkPolicy, OfflinePolicy, draft_offline, reconcile
from edge_client.pipelined_drafting import Speculation
from edge_client.reporting import GenerationResult, Listener
from shared.acceptance import AcceptanceMode
from shared.draft_q import Proposal, point_masses
from shared.drafting.aded import AdedDrafter
from shared.drafting.pld import PromptLookupDrafter
from shared.drafting.base import Drafter, ReadsActivations, reads_activations
from shared.drafting.budget import TreeBudget
from shared.messages import ActivationRows, Limits, Opened, Verdict
from shared.sampling import RngStream, round_rng
from shared.tree import DraftTree

T = TypeVar("T")


def fallback_tree(context: Sequence[int]) -> DraftTree:
    """When a drafter has nothing, guess the last token repeats: the round still yields the
    target's own token, at the cost of one extra node in the forward pass."""
    return DraftTree.chain([context[-1]])


class GenerationDrafts:
    def __init__(self, drafter: Drafter, budget: TreeBudget, result: GenerationResult,
                 listener: Listener, limits: Limits, drafting: Executor | None):
        self.drafter, self.budget, self.result, self.listener = drafter, budget, result, listener
        self.drafting = drafting
        # offline tokens verified per round: the server refuses trees past its limits
        self.max_chain = min(limits.max_tree_nodes, limits.max_tree_depth)
        self.offline: list[int] = []  # unverified tokens continuing the committed text
        self.checking_offline = False  # the last tree sent is offline text
        self.rows_held = 0  # leading positions whose activation rows the drafter holds
        self._session: Opened | None = None
        self._ready_tree: DraftTree | None = None  # from a speculation that came true
        self._speculation: Speculation | None = None  # drafted during a lock-step round
        self._sent_at = 0.0  # when the last tree went (perf_counter)
        self._draft_ms: float | None = None  # drafting it in its round (None: drafted ahead)
        self.server_nodes = 0  # the size the latest Verdict gave the next draft (0: none)
        self._alone: Drafter | None = None  # offline, for a drafter that was sent no rows
        self._lookup = PromptLookupDrafter()  # offline, first: the text's own continuation

    def opened(self, session: Opened) -> None:
        """The session's acceptance rule and seed, which sampled drafts follow."""
        self._session = session

    def resumed(self) -> None:
        """A new stream: what was drafted ahead for the old one is void."""
        self._ready_tree = self._speculation = None

    @property
    def sampled(self) -> bool:
        return (self._session is not None
                and self._session.acceptance is AcceptanceMode.SAMPLED_DRAFTS)

    async def next_tree(self, context: Sequence[int]) -> Proposal:
        """The tree to send with the q its drafts were drawn from (acceptance sampled-drafts
        only); `checking_offline` then says whether it is offline text being checked."""
        self.checking_offline = bool(self.offline)
        self._draft_ms = None
        if self.offline:
            return self._with_q(Proposal(DraftTree.chain(self.offline[: self.max_chain])))
        ready, self._ready_tree = self._ready_tree, None
        if ready is not None:
            return self._with_q(Proposal(ready))
        start = time.perf_counter()
        proposal = await self.off_loop(self._draft, context)
        spent = time.perf_counter() - start
        self.result.draft_s += spent
        self._draft_ms = 1000 * spent
        if not len(proposal.tree):
            proposal = Proposal(fallback_tree(context))
        return self._with_q(proposal)

    def nodes(self) -> int:
        """The next draft's size: a paced server's (Verdict.draft_nodes: one budget sizes the
        draft and the forward that verifies it), capped by a size the user fixed; else the
        edge's own budget (lock-step)."""
        server, fixed = self.server_nodes, self.budget.fixed
        if not server:
            return self.budget.nodes()
        return server if fixed is None else min(server, fixed)

    def sent(self) -> None:
        self._sent_at = time.perf_counter()

    async def speculate(self, context: Sequence[int], tree: DraftTree) -> None:
        """While a lock-step server verifies `tree`, drafts the next one for the path it
        expects (pipelined_drafting.py); never for offline text or drawn trees."""
        if self.checking_offline or self.sampled:
            return
        self._speculation = await self.off_loop(Speculation.draft, self.drafter, context, tree,
                                                self.nodes())

    def take_speculation(self, verdict: Verdict) -> None:
        """The tree drafted ahead during the round comes true when the Verdict took the path it
        expected; it is then the next round's draft."""
        speculation, self._speculation = self._speculation, None
        if speculation is None:
            return
        self.result.speculations += 1
        self._ready_tree = speculation.next_tree(verdict.tokens)
        if self._ready_tree is not None:
            self.result.speculation_hits += 1
            self.result.hidden_draft_s += speculation.spent_s

    def learn(self, context: Sequence[int], tree: DraftTree | None, verdict: Verdict,
              lockstep: bool) -> None:
        """What a Verdict teaches: `tree` is the edge's draft it verified, re-rooted at its
        base (None: it verified none of the edge's nodes). In lock-step the edge's budget sizes
        its trees, weighing each by the round trip it held the text up; a paced server sizes
        them itself (Verdict.draft_nodes). Offline text checked is not a drafted tree."""
        if tree is None:
            return
        self.drafter.observe(context, tree, verdict.accepted_nodes, verdict.tokens)
        if self.checking_offline or not lockstep:
            return
        held_ms = 1000 * (time.perf_counter() - self._sent_at)
        self.budget.observe(len(tree), verdict.accepted_nodes, held_ms, verdict.verify_ms,
                            self._draft_ms)

    def committed(self, tokens: Sequence[int]) -> None:
        """The server committed `tokens`: the offline text keeps what they confirm."""
        pending, rewound = reconcile(self.offline, list(tokens))
        self.result.kept_tokens += len(self.offline) - len(pending) - rewound
        self.result.corrected_tokens += rewound
        self.offline = pending

    def rows_in(self, context: Sequence[int]) -> bool:
        """The drafter holds what it reads to draft from `context`: a drafter fed the
        server's rows needs every position's but the newest token's (its row comes with
        the next Verdict)."""
        return not reads_activations(self.drafter) or self.rows_held >= len(context) - 1

    async def add_rows(self, rows: ActivationRows) -> None:
        drafter = self.drafter
        if not isinstance(drafter, ReadsActivations):
            raise ValueError(f"the {drafter.name} drafter reads no activations")
        await self.off_loop(drafter.add_activations, rows.start, rows.values)
        self.rows_held = rows.start + len(rows.values)

    async def draft_offline(self, context: Sequence[int], room: int,
                            policy: LinkPolicy) -> None:
        """Drafts on while the link is down (Outages.ride_out), at most `room` tokens past
        what is drafted already, as the policy allows."""
        room = min(room, policy.offline_limit) - len(self.offline)
        if policy.offline is OfflinePolicy.WAIT or room <= 0:
            return
        start = time.perf_counter()
        new = await self.off_loop(draft_offline, (self._lookup, self._offline_drafter()),
                                  [*context, *self.offline], room, len(context))
        self.result.draft_s += time.perf_counter() - start
        self.offline += new
        self.result.offline_tokens += len(new)
        if new:
            self.listener.unverified(new)

    def _offline_drafter(self) -> Drafter:
        """What drafts offline where prompt lookup finds nothing (LOG offline_text: the pair
        writes text the target agrees with more, and loops less, than either alone): the
        drafter, or where it reads rows and the server sent it none (a session that rested
        from its first Verdict: rows cost a slow link more than its drafts earn), ADED's
        n-gram tables of the text, so that the edge still goes on alone."""
        if self.rows_held or not reads_activations(self.drafter):
            return self.drafter
        if self._alone is None:
            self._alone = AdedDrafter()
        return self._alone

    def _draft(self, context: Sequence[int]) -> Proposal:
        """Under sampled-drafts the tree is drawn from q, keyed by the committed length."""
        if not self.sampled or self._session is None:
            return Proposal(self.drafter.propose(context, self.nodes()))
        rng = round_rng(self._session.seed, RngStream.DRAFT, len(context))
        return self.drafter.propose_sampled(context, self.nodes(), rng)

    def _with_q(self, proposal: Proposal) -> Proposal:
        """Under sampled-drafts, a chain chosen without drawing (offline text, the fallback
        guess) goes with point masses as its q."""
        if self.sampled and not proposal.q:
            return Proposal(proposal.tree, point_masses(proposal.tree))
        return proposal

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """Runs the drafter's work `fn(*args)` where `drafting` says: a generation's calls
        stay in order, since each is awaited before the next."""
        if self.drafting is None:
            return fn(*args)
        job = asyncio.get_running_loop().run_in_executor(self.drafting, fn, *args)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:  # the drafter is not free for another until it ends
            await asyncio.wait({job})
            raise
