"""The edge's generation loop: answer each Verdict as it says (Verdict.next: a draft, or in a paced
session an acknowledgement now and then while the server says rest), commit what the server
verified, repeat; ride out a broken link by drafting
offline (the outage's timing: outages.py), then resume and let the server judge that text.
What it reports: reporting.py.

Knows the link, not the CLI; what it drafts, and what a Verdict teaches the drafter:
generation_drafts.py. The server is the authority on what is committed:
the edge only ever appends the tokens a Verdict carries, and offline tokens stay apart until a
Verdict confirms them (docs/architecture.md, Resume and offline mode).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor
from dataclasses import replace

from shared.drafting.budget import TreeBudget
from shared.drafting.base import Drafter
from edge_client.generation_drafts import GenerationDrafts
from edge_client.link import DecodeStream, LinkError, ServerLink, ServerUnreachable
from edge_client.paced_drafts import DraftFollower
from edge_client.offline import LinkPolicy
from edge_client.outages import Outages
from edge_client.reporting import GenerationResult, Listener, SilentListener
from shared.drafting.race import Race
from shared.messages import (
    ActivationRows, CloseRequest, Done, DraftRequest, FinishReason, Limits, Next, OpenRequest,
    Opened, Pace, Resume, Verdict,
)
from shared.tree import DraftTree

# How long a generation its caller gave up on waits for the server to end the session
CLOSE_TIMEOUT_S = 2.0


async def _expect(stream: DecodeStream, kind: type | tuple[type, ...],
                  timeout_s: float | None = None):
    msg = await stream.recv(timeout_s)
    if not isinstance(msg, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise LinkError(f"protocol error: expected {names}, got {type(msg).__name__}")
    return msg


class SplitGeneration:
    """One generation, across as many Decode streams as the link needs."""

    def __init__(self, link: ServerLink, drafter: Drafter, request: OpenRequest,
                 budget: TreeBudget, listener: Listener | None = None,
                 policy: LinkPolicy = LinkPolicy(), limits: Limits = Limits(),
                 drafting: Executor | None = None):
        """`drafting`: where the drafter runs (None: on the event loop), so that generations
        sharing a loop do not wait for each other's drafting."""
        self.link, self.drafter, self.request = link, drafter, request
        self.listener = listener or SilentListener()
        self.policy = policy
        self.result = GenerationResult()
        self.drafts = GenerationDrafts(drafter, budget, self.result, self.listener, limits,
                                       drafting)
        self.opened: Opened | None = None
        self.context: list[int] = []  # prompt + committed tokens
        self.finish = FinishReason.NOT_FINISHED
        self.told: Next | None = None  # what the latest Verdict told the edge to do
        self._owed = False  # a draft the latest Verdict asked for waits for its rows
        self.outages = Outages(policy, self.listener, self.result)
        self._answered_at: float | None = None  # when Done arrived

    async def run(self) -> GenerationResult:
        start = time.perf_counter()
        while self.finish is FinishReason.NOT_FINISHED:
            try:
                await self._stream(start)
            except ServerUnreachable as err:
                if not await self.outages.ride_out(err, self.drafts.offline,
                                                   self._draft_offline):
                    break
        self.result.finish_reason = self.finish
        self.result.wall_s = (self._answered_at or time.perf_counter()) - start
        return self.result

    async def _stream(self, start: float) -> None:
        stream = self.link.decode(wait_for_ready=self.outages.down)
        try:
            await self._open(stream, start)
            await self._decode(stream)
            await _expect(stream, Done)
            self._answered_at = time.perf_counter()
            with contextlib.suppress(LinkError):  # the answer is complete; a late drop is moot
                await stream.send(CloseRequest())  # received all: free the session
                await stream.finish()
        except asyncio.CancelledError:
            await _close_abandoned(stream)
            raise
        finally:
            stream.cancel()
            self.result.bytes_up += stream.bytes_up
            self.result.messages_up += stream.messages_up
            self.result.bytes_down += stream.bytes_down

    def _open_request(self) -> OpenRequest:
        request = self.request
        if self.result.rtt_s:  # a resume: the round trip measured at the first Open
            request = replace(request, rtt_ms=max(1, round(1000 * self.result.rtt_s)))
        if self.opened is None:
            return request
        o = self.opened
        return replace(request, prompt_ids=o.prompt_ids, chat=None, acceptance=o.acceptance,
                       sampling=replace(self.request.sampling, seed=o.seed),
                       resume=Resume(o.session_id, tuple(self.context[len(o.prompt_ids):]),
                                     self.drafts.rows_held))

    async def _open(self, stream: DecodeStream, start: float) -> None:
        resuming = self.opened is not None
        timeout_s = self.link.config.resume_timeout_s if self.outages.down else None
        sent = time.perf_counter()
        await stream.send(self._open_request(), timeout_s)
        opened: Opened = await _expect(stream, Opened, timeout_s)
        verdict: Verdict = await _expect(stream, Verdict, timeout_s)
        server_s = (verdict.verify_ms + verdict.queue_ms) / 1000  # the prefill: no link time
        self.result.prefill_s += verdict.verify_ms / 1000
        if self.outages.down:
            self.outages.link_back(opened, resuming)
        if resuming:
            self.result.reconnects += 1
            self.result.rebuilt_sessions += not opened.resumed
            self.drafts.resumed()
            if self.drafts.offline:
                self.listener.withdraw()
        else:
            self.opened = opened
            self.drafts.opened(opened)
            self.context = list(opened.prompt_ids)
            self.result.prompt_ids = list(opened.prompt_ids)
            self.drafter.reset(self.context)
            self.drafter.follow_race(Race.of(opened.acceptance, opened.seed,
                                             self.request.sampling))
            self.result.ttft_s = time.perf_counter() - start
            self.result.rtt_s = max(0.0, time.perf_counter() - sent - server_s)
            self.result.pace = opened.pace
        await self._commit(verdict)

    @property
    def _session(self) -> Opened:
        """What the server answered the first Open (the generation's session)."""
        if self.opened is None:
            raise LinkError("protocol error: no session opened yet")
        return self.opened

    async def _decode(self, stream: DecodeStream) -> None:
        """Answers each Verdict as it says until the generation ends (`_answer`). Rows that
        trail a Verdict are acknowledged, so that the server sends more, and a draft that
        waited for them goes once they are in."""
        follower = DraftFollower(self.result.drafts)
        await self._answer(stream, follower)
        while self.finish is FinishReason.NOT_FINISHED:
            verdict = await _expect(stream, (Verdict, ActivationRows))
            if isinstance(verdict, ActivationRows):  # rows that trail a Verdict (wire.trailing)
                await self.drafts.add_rows(verdict)
                if self._owed and self.drafts.rows_in(self.context):
                    await self._answer(stream, follower)
                else:  # it acknowledges the rows, not a Verdict: the base the edge last sent
                    await stream.send(follower.sent(replace(
                        self._acknowledgement(), base_length=follower.last_base)))
                continue
            self.drafts.learn(self.context, follower.verified(verdict, self.context), verdict,
                              self._session.pace is Pace.LOCKSTEP)
            self.result.rounds += 1
            self.result.accepted_tokens += len(verdict.accepted_nodes)
            await self._commit(verdict)
            self.drafts.take_speculation(verdict)
            if self.finish is FinishReason.NOT_FINISHED:
                await self._answer(stream, follower)

    async def _answer(self, stream: DecodeStream, follower: DraftFollower) -> None:
        """Told to rest, acknowledges now and then (DraftFollower.needless). Told to draft,
        sends offline text to check, or a fresh draft once the rows it reads are in, or only
        an acknowledgement while the last draft still continues the text (the server re-roots
        it). While a lock-step server verifies a draft, the edge drafts the next one for the
        path it expects (pipelined_drafting.py)."""
        draft, self._owed = self._acknowledgement(), False
        if self.told is Next.REST:
            if not follower.needless(draft, self._session.lead):
                await stream.send(follower.sent(draft))
            return
        if follower.due(self.context):
            if not self.drafts.offline and not self.drafts.rows_in(self.context):
                self._owed = True  # the rows trail the Verdict: drafted when they are in
                return
            proposal = await self.drafts.next_tree(self.context)
            self.result.drafted_tokens += len(proposal.tree)
            draft = replace(draft, tree=proposal.tree, q=proposal.q)
        self.drafts.sent()
        await stream.send(follower.sent(draft))
        if len(draft.tree) and self._session.pace is Pace.LOCKSTEP and self.policy.pipeline:
            await self.drafts.speculate(self.context, draft.tree)

    def _acknowledgement(self) -> DraftRequest:
        """A draft without nodes: the committed length and the rows the edge holds."""
        return DraftRequest(0, len(self.context), DraftTree((), ()),
                            rows_held=self.drafts.rows_held)

    async def _commit(self, verdict: Verdict) -> None:
        if verdict.committed_length != len(self.context) + len(verdict.tokens):
            raise LinkError(f"protocol error: server holds {verdict.committed_length} tokens, "
                            f"the edge {len(self.context) + len(verdict.tokens)}")
        if verdict.activations is not None:
            await self.drafts.add_rows(verdict.activations)
        tokens = list(verdict.tokens)
        self.context.extend(tokens)
        self.result.output_ids.extend(tokens)
        self.result.verify_s += verdict.verify_ms / 1000
        self.drafts.committed(tokens)
        self.finish, self.told = verdict.finish_reason, verdict.next
        self.drafts.server_nodes = verdict.draft_nodes
        if tokens:
            self.listener.committed(tokens)

    async def _draft_offline(self) -> None:
        """Drafts on while the link is down, up to the answer's length cap."""
        if self.opened is None:
            return
        room = self.policy.offline_limit
        if self.request.max_new_tokens:
            generated = len(self.context) - len(self.opened.prompt_ids)
            room = self.request.max_new_tokens - generated
        await self.drafts.draft_offline(self.context, room, self.policy)


async def _close_abandoned(stream: DecodeStream) -> None:
    """The caller gave up on the generation (an HTTP client hung up): closes the session, so
    that the server frees it now. A stream that merely breaks keeps its session for a resume,
    and a paced one goes on committing up to its lead; nobody will resume this one."""
    with contextlib.suppress(LinkError, asyncio.TimeoutError):
        await stream.close_early(CLOSE_TIMEOUT_S)


async def split_generate(link: ServerLink, drafter: Drafter, request: OpenRequest,
                         budget: TreeBudget, listener: Listener | None = None,
                         policy: LinkPolicy = LinkPolicy(), limits: Limits = Limits(),
                         drafting: Executor | None = None) -> GenerationResult:
    """Runs one generation to its end (see SplitGeneration)."""
    return await SplitGeneration(link, drafter, request, budget, listener, policy, limits,
                                 drafting).run()
