"""An open session served over its stream by the one decode loop (decode_loop.py): a Decode
session at its pace, or server-side generation, each ended by Done; a paced session whose
stream breaks goes on alone up to its lead.

Knows sessions, the batcher and the client's stream as domain messages (client_stream.py), not
gRPC: the service opens or resumes the session and hands it here.
"""
from __future__ import annotations

import asyncio
import enum
import logging
from typing import Awaitable, Callable

from cloud_server.decoding.batching import Batcher
from cloud_server.rpc.client_stream import ClientStream
from cloud_server.config import ServerConfig
from cloud_server.decoding.decode_loop import DecodeLoop, Forward
from cloud_server.decoding.forward_builder import ForwardBuilder
from cloud_server.decoding.pacing import PaceMemory, PaceRule
from cloud_server.decoding.server_decoding import ServerDecoder, own_drafter
from cloud_server.decoding.session import Session
from cloud_server.decoding.session_table import SessionTable
from cloud_server.rpc.stream_buffers import Inbox, Outbox
from shared import wire
from shared.errors import OutOfOrder, SplitDecodingError
from shared.messages import CloseRequest, DraftRequest, Next, OpenRequest, Verdict

log = logging.getLogger(__name__)
# A paced Verdict carries its activations inside up to this size (a forward's few rows); more
# (a prompt's) follow it. 16 KiB holds a token up for 64 ms on a 2 Mbit/s link.
INLINE_ACTIVATION_BYTES = 16 * 1024
# Rows a client that acknowledges them may have unacknowledged: half the client's 64 KB HTTP/2
# window (edge_client/link.py), so a Verdict never waits for the window to reopen.
ROWS_IN_FLIGHT_BYTES = 32 * 1024
ROWS_PART_BYTES = 16 * 1024


async def _nobody(verdict: Verdict) -> None:
    """Where a session going on alone sends its Verdicts: the resume's catch-up carries them."""


class _Ended(enum.Enum):
    """How a paced session's client stream ended."""

    CLOSED = 1  # the client sent Close
    GONE = 2  # the stream ended, or another stream took the session over


class SessionStreams:
    """Serves the server's sessions over their streams; `owner` is the stream as the session
    table knows it, so a resume on another stream stops this one."""

    def __init__(self, sessions: SessionTable, batcher: Batcher, config: ServerConfig,
                 verify_costs: tuple[tuple[int, float], ...], vocab_size: int):
        self.sessions = sessions
        self.batcher = batcher
        self.config = config
        self.verify_costs = verify_costs
        self.vocab_size = vocab_size
        self._alone: set[asyncio.Task] = set()  # sessions going on after their stream broke
        self.paces = PaceMemory()

    async def decode(self, session: Session, stream: ClientStream, owner: object,
                     first: Callable[[], Awaitable[Verdict]], client: str, rtt_ms: int
                     ) -> bool:
        """Sends the Verdict `first()` makes (the prefill's or a resume's), then runs the decode
        loop at the session's pace (decode_loop.py), the client's drafts read as they come;
        then Done. `client` names the client whose pace the server learns (PaceMemory);
        `rtt_ms`: its round trip as its Open said (0: unknown). Drafts
        still in flight after Done are dropped until the client says Close, and anything after
        Close is refused as addressed to a closed session. True when the session ended with
        Close; False when the stream stopped first (the client went away, or a resume on
        another stream took the session over)."""
        inbox = Inbox(len(session.committed), answers_each=not session.paced)
        own = self.config.pacing.drafter if session.paced else None
        builder = ForwardBuilder(session, self._own_decoder(session, own, 0), self.verify_costs)
        outbox = self._outbox(stream, session)
        rule = self.paces.rule(client, session.spec.pace, rtt_ms / 1000 if rtt_ms else None,
                               self.verify_costs[0][1] / 1000)
        busy = lambda: self.config.pacing.load_wait and self.batcher.pending > 0  # noqa: E731

        def told(next_: Next | None) -> None:
            session.pause_rows(next_ is Next.REST)
            outbox.pause(next_ is Next.REST)

        loop = DecodeLoop(session, inbox, rule, self._forward(builder, session.id),
                          outbox.send, session.spec.lead,
                          lambda: self.sessions.owns(session, owner), busy, told,
                          builder.draft_nodes if session.paced else lambda: 0)
        reader = asyncio.create_task(self._fill(session, stream, owner, inbox, outbox,
                                                loop.opened))
        try:
            # its rows can take the link a second: no forward waits for them, only for the
            # Verdict to be handed to gRPC (Outbox.send)
            await loop.run(first)
            self.paces.keep(client, rule)
            if not session.finished and await reader is _Ended.GONE:
                self._go_on_alone(session, builder, inbox.acked)
                return False
            await outbox.flush()
            await stream.send(session.done())
            # A stream that ends without Close keeps the session for a resume: a link that
            # went dark may have swallowed the last Verdicts, and its end can look like a
            # clean half-close.
            if await reader is not _Ended.CLOSED:
                return False
            if await stream.read() is not None:
                raise OutOfOrder(f"session {session.id} is closed")
            return True
        except SplitDecodingError:
            raise
        except BaseException:  # the stream broke
            if loop.opened.is_set():
                self._go_on_alone(session, builder, inbox.acked)
            raise
        finally:
            reader.cancel()
            outbox.cancel()

    async def server_only(self, session: Session, stream: ClientStream,
                          drafter: str | None, tree_nodes: int) -> None:
        """Server-side generation (Generate): the server drafts for itself with `drafter`,
        trees of `tree_nodes` (0: sized by the budget), and streams every Verdict, then Done:
        the decode loop never waiting, with no client to wait for."""
        own = self._own_decoder(session, drafter, tree_nodes)
        builder = ForwardBuilder(session, own, self.verify_costs, names_own=True)
        await stream.send(session.opened())
        await stream.send(await self.batcher.run(own.prefilling(), session.id))
        await DecodeLoop(session, Inbox(len(session.committed), fed=False), PaceRule(),
                         self._forward(builder, session.id), stream.send).run()
        await stream.send(session.done())

    def _own_decoder(self, session: Session, drafter: str | None,
                     tree_nodes: int) -> ServerDecoder:
        return ServerDecoder(session, own_drafter(drafter, self.config.limits), tree_nodes,
                             self.verify_costs, lambda: self.batcher.last)

    def _forward(self, builder: ForwardBuilder, key: str | None) -> Forward:
        """The loop's forward: `builder`'s work run by the batcher, gathered under `key`
        (None: alone)."""
        return lambda draft, queued_at: self.batcher.run(builder.stepping(draft, queued_at),
                                                         key)

    def _go_on_alone(self, session: Session, builder: ForwardBuilder, acked: int) -> None:
        """A paced session's stream broke mid-generation: the decode loop goes on with nobody
        to send to, committing up to its lead past what the edge acknowledged, as it does when
        the link goes dark without breaking, so a resume finds the tokens ready instead of the
        outage's worth of forwards still to run. It stops at the lead, at the end, or when a
        resume takes the session over. A lock-step session waits for its client."""
        if session.finished or not session.paced:
            return
        loop = DecodeLoop(session, Inbox(acked, fed=False), PaceRule(),
                          self._forward(builder, None), _nobody, session.spec.lead,
                          lambda: self.sessions.owns(session, None))
        task = asyncio.get_running_loop().create_task(loop.run())
        self._alone.add(task)
        task.add_done_callback(self._alone_done)

    def _alone_done(self, task: asyncio.Task) -> None:
        self._alone.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a detached session stopped: %s", task.exception())

    async def _fill(self, session: Session, stream: ClientStream, owner: object, inbox: Inbox,
                    outbox: Outbox, opened: asyncio.Event) -> _Ended:
        """Once the first Verdict is made (`opened`), reads the client's drafts into the inbox,
        and the rows it says it holds into the outbox, until it closes, the stream ends or
        another stream takes the session over; drafts that arrive after the end are
        dropped."""
        try:
            await opened.wait()
            while True:
                msg = await stream.read()
                if msg is None or not self.sessions.owns(session, owner):
                    return _Ended.GONE
                if isinstance(msg, CloseRequest):
                    return _Ended.CLOSED
                if isinstance(msg, OpenRequest):
                    raise OutOfOrder("a session is already open on this stream")
                if not session.finished:
                    self._check_draft(session, msg)
                    inbox.put(msg, len(session.committed))
                    if msg.rows_held is not None:
                        outbox.held(msg.rows_held)
        finally:
            inbox.close()

    def _check_draft(self, session: Session, draft: DraftRequest) -> None:
        """An empty draft only acknowledges, but in lock-step each round needs a tree."""
        if len(draft.tree) or not session.paced:
            limits = self.config.limits
            draft.tree.validate(self.vocab_size, limits.max_tree_nodes, limits.max_tree_depth)

    def _outbox(self, stream: ClientStream, session: Session) -> Outbox:
        """A paced session's Verdict goes before its activations when they are many (the
        prompt's): the client shows the tokens at once and the server runs on meanwhile. The
        rows go in small parts, a few in flight, as the client acknowledges them
        (stream_buffers.py, Outbox). In lock-step the client drafts from the rows next, so
        they stay inside (ClientStream.send); a session without rows needs neither."""
        if not session.paced or session.spec.activations is None:
            return Outbox(stream.send)
        part = min(ROWS_PART_BYTES, self.config.limits.max_message_bytes // 2)
        return Outbox(stream.send,
                      lambda verdict: wire.trailing(verdict, INLINE_ACTIVATION_BYTES, part),
                      ROWS_IN_FLIGHT_BYTES)

    def shutdown(self) -> None:
        """Stops the sessions going on alone."""
        for task in list(self._alone):
            task.cancel()
