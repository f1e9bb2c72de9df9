"""The edge's generation loop: answer each Verdict (a draft, or in a paced session maybe only an
acknowledgement), commit what the server verified, repeat; ride out a broken link by drafting
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
from edge_client.paced_drafts import DraftFollower, DraftSpacing
from edge_client.offline import LinkPolicy
from edge_client.outages import Outages
from edge_client.reporting import GenerationResult, Listener, SilentListener
from shared.drafting.race import Race
from shared.messages import (
    ActivationRows, CloseRequest, Done, DraftRequest, FinishReason, Limits, OpenRequest, Opened,
    Pace, Resume, Verdict,
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
                 spacing: DraftSpacing | None = None, drafting: Executor | None = None):
        """`spacing`: paced sessions, whether the edge rests from drafting; the client carries
        it from one generation to the next on the same link (DraftSpacing.carried).
        `drafting`: where the drafter runs (None: on the event loop), so that generations
        sharing a loop do not wait for each other's drafting."""
        self.link, self.drafter, self.request = link, drafter, request
        self.listener = listener or SilentListener()
        self.policy = policy
        self.spacing = spacing or DraftSpacing(reads_rows=request.acks_rows)
        self.result = GenerationResult()
        self.drafts = GenerationDrafts(drafter, budget, self.result, self.listener, limits,
                                       drafting)
        self.opened: Opened | None = None
        self.context: list[int] = []  # prompt + committed tokens
        self.finish = FinishReason.NOT_FINISHED
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
        request = replace(self.request, rows_paused=self.request.acks_rows
                          and self.spacing.resting)
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
        """Answers each Verdict until the generation ends: with a draft from the new committed
        position, or, in a paced session, only an acknowledgement while its last draft still
        continues the text (the server re-roots it) or the edge rests. In lock-step every
        answer is a draft: the server waits for it, and the edge never rests."""
        lockstep = self._session.pace is Pace.LOCKSTEP
        spacing = DraftSpacing(self.spacing.reads_rows, rests=False) if lockstep else self.spacing
        follower = DraftFollower(spacing, self.result.drafts)
        await self._answer(stream, follower, awaited=True)
        while self.finish is FinishReason.NOT_FINISHED:
            verdict = await _expect(stream, (Verdict, ActivationRows))
            if isinstance(verdict, ActivationRows):  # rows that trail a Verdict (wire.trailing)
                await self.drafts.add_rows(verdict)
                # The server sends more as these are acknowledged; a resting edge wants none.
                if self.request.acks_rows and not follower.spacing.resting:
                    await stream.send(follower.sent(self._acknowledgement()))
                continue
            self.drafts.learn(self.context, follower.verified(verdict, self.context), verdict,
                              lockstep)
            self.result.rounds += 1
            self.result.accepted_tokens += len(verdict.accepted_nodes)
            await self._commit(verdict)
            self.drafts.take_speculation(verdict)
            if self.finish is FinishReason.NOT_FINISHED:
                await self._answer(stream, follower, verdict.answer_awaited)

    async def _answer(self, stream: DecodeStream, follower: "DraftFollower",
                      awaited: bool) -> None:
        """Drafts when one is due and drafts pay (paced_drafts.py, DraftSpacing); offline text goes
        at once, since the server checks it only as a draft. Else only acknowledges, and only
        now and then where the edge rests or the server does not wait for the answer
        (`awaited`; DraftFollower.needless). While a lock-step server verifies a draft, the
        edge drafts the next one for the path it expects (pipelined_drafting.py)."""
        draft = self._acknowledgement(rows_paused=follower.spacing.resting)
        due = follower.due(self.context, self.result.link_slow)
        if due and (self.drafts.offline or follower.spacing.chance()):
            proposal = await self.drafts.next_tree(self.context)
            self.result.drafted_tokens += len(proposal.tree)
            draft = replace(draft, tree=proposal.tree, q=proposal.q)
        if follower.needless(draft, self._session.lead, awaited):
            return
        self.drafts.sent()
        await stream.send(follower.sent(draft))
        if len(draft.tree) and self._session.pace is Pace.LOCKSTEP and self.policy.pipeline:
            await self.drafts.speculate(self.context, draft.tree)

    def _acknowledgement(self, rows_paused: bool = False) -> DraftRequest:
        """A draft without nodes: the committed length, the rows the edge holds and whether it
        wants more of them now."""
        if not self.request.acks_rows:
            return DraftRequest(0, len(self.context), DraftTree((), ()))
        return DraftRequest(0, len(self.context), DraftTree((), ()),
                            rows_held=self.drafts.rows_held, rows_paused=rows_paused)

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
        self.finish = verdict.finish_reason
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
                         spacing: DraftSpacing | None = None,
                         drafting: Executor | None = None) -> GenerationResult:
    """Runs one generation to its end (see SplitGeneration)."""
    return await SplitGeneration(link, drafter, request, budget, listener, policy, limits,
                                 spacing, drafting).run()
