"""The gRPC boundary: protobuf in, domain calls on the model thread, protobuf out.

Model work never runs on the event loop: it runs on the model thread (model_thread.py), where
the forwards of sessions ready at the same time run as one batch (batching.py), each session
keeping its own KV cache. Domain errors become gRPC status codes here and nowhere else.
"""
from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from google.protobuf.message import DecodeError

from cloud_server.artifacts import ArtifactStore
from cloud_server.batching import Batcher
from cloud_server.config import ServerConfig
from cloud_server.drafter_serving import ServedDrafter
from cloud_server.metrics import Metrics
from cloud_server.model_thread import ModelThread
from cloud_server.paced_decoder import PacedDecoder
from cloud_server.pacing import run_paced
from cloud_server.server_decoding import ServerDecoder, own_drafter
from cloud_server.session import Session
from cloud_server.security import caller
from cloud_server.session_table import SessionTable
from cloud_server.stream_buffers import Inbox, Outbox
from cloud_server.target import TargetModel
from shared import wire
from shared.drafting.budget import Load
from shared.errors import (
    Forbidden, InvalidRequest, NotFound, OutOfOrder, Overloaded, SplitDecodingError,
)
from shared.messages import (
    PROTOCOL_VERSION, ActivationRows, CloseRequest, DraftRequest, OpenRequest, Pace,
    ServerInfo, ServerMessage, Verdict,
)
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

T = TypeVar("T")
log = logging.getLogger(__name__)
CHUNK_BYTES = 256 * 1024
# A paced Verdict carries its activations inside up to this size (a forward's few rows); more
# (a prompt's) follow it. 16 KiB holds a token up for 64 ms on a 2 Mbit/s link.
INLINE_ACTIVATION_BYTES = 16 * 1024
# Rows a client that acknowledges them may have unacknowledged: half the client's 64 KB HTTP/2
# window (edge_client/link.py), so a Verdict never waits for the window to reopen.
ROWS_IN_FLIGHT_BYTES = 32 * 1024
ROWS_PART_BYTES = 16 * 1024
STATUS_OF = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
}


class _Ended(enum.Enum):
    """How a paced session's client stream ended."""

    CLOSED = 1  # the client sent Close
    GONE = 2  # the stream ended, or another stream took the session over


class StreamBroken(Exception):
    """The client's stream died under a write: nobody is left to tell."""


async def _send_parts(context, msg: ServerMessage, max_bytes: int) -> int:
    """Writes `msg`; a Verdict whose activations pass `max_bytes` goes in parts. Returns the
    bytes written."""
    parts = wire.verdict_parts(msg, max_bytes) if isinstance(msg, Verdict) else [msg]
    return sum([await _write(context, part) for part in parts])


async def _write(context, msg: ServerMessage) -> int:
    proto = wire.server_to_proto(msg)
    try:
        await context.write(proto)
        return proto.ByteSize()
    except asyncio.CancelledError:
        raise
    except Exception as err:  # grpc raises its internal ExecuteBatchError here
        raise StreamBroken(str(err)) from None


async def _abort(service: "SplitDecodingService", context, err: Exception,
                 handler_name: str) -> None:
    """Ends the call with the status a domain error maps to, with its message; anything else
    is a bug on our side: logged, and INTERNAL for the caller."""
    if isinstance(err, SplitDecodingError):
        service.metrics.refused.labels(STATUS_OF[type(err)].name.lower()).inc()
        await context.abort(STATUS_OF[type(err)], str(err))
    service.metrics.refused.labels("internal").inc()
    log.exception("internal error in %s", handler_name)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err}")


def _grpc_status(handler):
    """Maps what a unary or stream-in handler raises to a gRPC status (see _abort)."""
    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except StreamBroken:
            return None
        except Exception as err:  # noqa: BLE001 - the boundary: the server must keep serving
            await _abort(self, context, err, handler.__name__)
    return wrapped


def _grpc_status_stream(handler):
    """_grpc_status for a handler that yields its responses (server streaming)."""
    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            async for response in handler(self, request, context):
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as err:  # noqa: BLE001 - the boundary: the server must keep serving
            await _abort(self, context, err, handler.__name__)
    return wrapped


class SplitDecodingService(pb_grpc.SplitDecodingServicer):
    def __init__(self, target: TargetModel, model_thread: ModelThread, config: ServerConfig,
                 artifacts: ArtifactStore, verify_costs: tuple[tuple[int, float], ...] = (),
                 drafter: ServedDrafter | None = None):
        """`verify_costs`: (tree nodes, ms) as measured at start (calibrate.py), for Info;
        `drafter`: the drafter's server half, when one is served."""
        self.target = target
        self.config = config
        self.pacing = config.pacing
        self.drafter = drafter
        self.verify_costs = verify_costs
        self.limits = config.limits
        self.artifacts = artifacts
        self.sessions = SessionTable(config.limits, kv_budget_bytes=config.kv_budget_bytes)
        self._model_thread = model_thread
        self._reaper: asyncio.Task | None = None
        self._alone: set[asyncio.Task] = set()  # sessions going on after their stream broke
        self.metrics = Metrics()
        self.metrics.sessions_open.set_function(lambda: len(self.sessions))
        self.batcher = Batcher(model_thread, target, config.batch_tokens,
                               self.metrics.forwarded)

    def info(self) -> ServerInfo:
        return ServerInfo(
            protocol_version=PROTOCOL_VERSION, model_id=self.target.model_id,
            tokenizer_sha256=self.artifacts.tokenizer().sha256,
            vocab_size=self.target.vocab_size, stop_token_ids=self.target.stop_token_ids(),
            limits=self.limits, artifacts=self.artifacts.listing(),
            verify_costs=self.verify_costs,
            activation_width=0 if self.drafter is None else self.drafter.width,
            draft_graphs=True)

    @_grpc_status
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return wire.info_to_proto(self.info())

    @_grpc_status_stream
    async def FetchArtifact(self, request: pb.FetchArtifactRequest, context
                            ) -> AsyncIterator[pb.ArtifactChunk]:
        found = self.artifacts.get(request.name)
        if found is None:
            raise NotFound(f"no artifact named {request.name!r}")
        info, data = found
        chunk = min(CHUNK_BYTES, self.limits.max_message_bytes // 2)
        for offset in range(0, len(data), chunk):
            yield pb.ArtifactChunk(data=data[offset: offset + chunk], offset=offset,
                                   total_size=len(data), sha256=info.sha256)

    @_grpc_status
    async def Decode(self, request_iterator, context) -> None:
        opening = await self._read(context)
        if opening is None:
            return
        if not isinstance(opening, OpenRequest):
            raise OutOfOrder("no open session on this stream: the first message must be open")
        owner = object()  # this stream, as the session table knows it
        session, resumed = await self._attach(opening, owner, caller(context))
        session.pause_rows(opening.rows_paused)  # a resumed session: as this stream asks
        try:
            # Opened goes first, its prompt ids on the link while the prompt runs (as
            # Generate's): after the prefill they came between the first token and the client
            await self._send(context, session.opened(resumed))
            first = (await self._on_model(session.catch_up, opening.resume) if resumed
                     else await self.batcher.run(session.prefilling(), session.id))
            if session.pace is Pace.LOCKSTEP:
                await self._send(context, first)
                ended = await self._serve_rounds(session, context, owner)
            else:
                ended = await self._serve_paced(session, context, owner, first,
                                                opening.rows_paused)
        except SplitDecodingError:
            self.sessions.release(session, owner)
            raise
        except BaseException:  # the stream broke (cancelled, reset): keep it for a resume
            self.sessions.detach(session, owner)
            raise
        finally:
            self.batcher.forget(session.id)
        if ended:
            self.sessions.release(session, owner)
        else:
            self.sessions.detach(session, owner)

    async def _attach(self, request: OpenRequest, owner: object, by: str | None
                      ) -> tuple[Session, bool]:
        """The stream's session, and whether it is an existing one taken over by a resume
        (only `by`, the client that opened it, may). A resume of a session the server no
        longer holds rebuilds it from the edge's history."""
        if request.resume is not None:
            if request.prompt_ids is None:
                raise InvalidRequest("resume needs the prompt as the input_ids Opened answered")
            held = self.sessions.take_over(request.resume.session_id, owner, by)
            if held is not None:
                if held.prompt_ids != request.prompt_ids:
                    self.sessions.detach(held, owner)
                    raise InvalidRequest(f"resume prompt does not match session {held.id}")
                self.metrics.sessions_opened.labels("resumed").inc()
                return held, True
        return await self._new_session(request, owner, by), False

    async def _new_session(self, request: OpenRequest, owner: object,
                           by: str | None = None) -> Session:
        self.sessions.reserve()
        pace, lead = self.pacing.resolve(request.pace, request.lead,
                                         reads_rows=request.activations is not None)
        request = replace(request, pace=pace, lead=lead)
        source = None if self.drafter is None else self.drafter.activations
        session = await self._on_model(Session, self.target, self.limits, request, source)
        self.sessions.add(session, owner, session.kv_bytes, by)
        how = "new" if request.resume is None else "rebuilt"
        self.metrics.sessions_opened.labels(how).inc()
        return session

    async def _serve_rounds(self, session: Session, context, owner: object) -> bool:
        """Verifies drafts until the generation finishes or the client closes, then says Done;
        anything sent after that is refused as addressed to a closed session. True when the
        session ended; False when the stream stopped first (the client went away mid-way, or a
        resume on another stream took the session over)."""
        while not session.finished:
            msg = await self._read(context)
            if msg is None or not self.sessions.owns(session, owner):
                return False
            if isinstance(msg, CloseRequest):
                break
            if isinstance(msg, OpenRequest):
                raise OutOfOrder("a session is already open on this stream")
            await self._send(context, await self._verify(session, msg))
        await self._send(context, session.done())
        if await self._read(context) is not None:
            raise OutOfOrder(f"session {session.id} is closed")
        return True

    async def _serve_paced(self, session: Session, context, owner: object,
                           first: Verdict, paused: bool) -> bool:
        """Sends `first` (the prefill's or a resume's Verdict), then runs forward after forward
        without waiting for the client (pacing.py), its drafts read as they come; then Done.
        `paused`: the client opened resting (Open.rows_paused): no rows, and no waiting for it,
        until a draft says otherwise. Returns as _serve_rounds does."""
        inbox = Inbox(len(session.committed))
        inbox.resting = paused
        own = ServerDecoder(session, own_drafter(self.pacing.drafter, self.limits), 0,
                            self.verify_costs, self._load)
        decoder = PacedDecoder(session, own, self.verify_costs)
        epoch = session.epoch
        outbox = self._outbox(context, session)
        outbox.held(0, paused)
        reader = asyncio.create_task(self._fill(session, context, owner, inbox, outbox))
        try:
            # its rows can take the link a second: no forward waits for them, only for the
            # Verdict to be handed to gRPC (Outbox.send)
            await outbox.send(first)
            await run_paced(lambda: len(session.committed),
                            lambda: session.finished or not self.sessions.owns(session, owner),
                            inbox, lambda draft, queued_at: self.batcher.run(
                                decoder.stepping(draft, queued_at, epoch), session.id),
                            outbox.send, session.pace, session.lead,
                            lambda: self.pacing.load_wait and self.batcher.pending > 0)
            if not session.finished and await reader is _Ended.GONE:
                self._go_on_alone(session, decoder, inbox.acked, epoch)
                return False
            await outbox.flush()
            await self._send(context, session.done())
            # Drafts still in flight are dropped until the client says Close. A stream that
            # ends without it keeps the session for a resume: a link that went dark may have
            # swallowed the last Verdicts, and its end can look like a clean half-close.
            return await reader is _Ended.CLOSED
        except SplitDecodingError:
            raise
        except BaseException:  # the stream broke
            self._go_on_alone(session, decoder, inbox.acked, epoch)
            raise
        finally:
            reader.cancel()
            outbox.cancel()

    def _go_on_alone(self, session: Session, decoder: PacedDecoder, acked: int,
                     epoch: int) -> None:
        """The stream broke mid-generation: the session goes on committing up to its lead
        past what the edge acknowledged, as it does when the link goes dark without breaking,
        so a resume finds the tokens ready instead of the outage's worth of forwards still to
        run. It stops at the lead, at the end, or when a resume takes the session over."""
        async def go_on() -> None:
            while (not session.finished and len(session.committed) - acked < session.lead
                   and session.epoch == epoch and self.sessions.owns(session, None)):
                work = decoder.stepping(None, time.perf_counter(), epoch)
                if await self.batcher.run(work) is None:  # no key: nobody to gather it for
                    break
        if session.finished:
            return
        task = asyncio.get_running_loop().create_task(go_on())
        self._alone.add(task)
        task.add_done_callback(self._alone_done)

    def _alone_done(self, task: asyncio.Task) -> None:
        self._alone.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a detached session stopped: %s", task.exception())

    async def _fill(self, session: Session, context, owner: object, inbox: Inbox,
                    outbox: Outbox) -> "_Ended":
        """Reads the client's drafts into the inbox, and the rows it says it holds into the
        outbox, until it closes, the stream ends or another stream takes the session over;
        drafts that arrive after the end are dropped."""
        try:
            while True:
                msg = await self._read(context)
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
                        outbox.held(msg.rows_held, msg.rows_paused)
                        session.pause_rows(msg.rows_paused)
        finally:
            inbox.close()

    def _check_draft(self, session: Session, draft: DraftRequest) -> None:
        if len(draft.tree):  # an empty draft only acknowledges
            limits = self.limits
            draft.tree.validate(self.target.vocab_size, limits.max_tree_nodes,
                                limits.max_tree_depth)

    @_grpc_status
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        self.metrics.received(request.ByteSize())
        req = wire.generate_from_proto(request)
        if req.open.resume is not None:
            raise InvalidRequest("generate cannot resume a session; open a new one")
        owner = object()
        session = await self._new_session(req.open, owner)
        try:
            decoder = ServerDecoder(session, own_drafter(req.drafter, self.limits), req.tree_nodes,
                                    self.verify_costs, self._load)
            await self._send(context, session.opened())
            await self._send(context, await self.batcher.run(decoder.prefilling(), session.id))
            while not session.finished:
                await self._send(context, await self.batcher.run(decoder.stepping(),
                                                                 session.id))
            await self._send(context, session.done())
        finally:
            self.batcher.forget(session.id)
            self.sessions.release(session, owner)

    def _load(self) -> Load:
        return self.batcher.last

    async def _verify(self, session: Session, draft: DraftRequest) -> Verdict:
        return await self.batcher.run(session.verify(draft, time.perf_counter()), session.id)

    async def _send(self, context, msg: ServerMessage) -> None:
        # Half the message limit for the activations leaves room for the rest of a Verdict.
        self.metrics.sent(msg, await _send_parts(context, msg,
                                                 self.limits.max_message_bytes // 2))

    def _outbox(self, context, session: Session) -> Outbox:
        """A paced session's Verdict goes before its activations when they are many (the
        prompt's): the client shows the tokens at once and the server runs on meanwhile. A
        client that acknowledges rows gets them in small parts, a few in flight (pacing.py,
        Outbox). In lock-step the client drafts from the rows next, so they stay inside
        (`_send`), as they do for a client that does not read trailing rows."""
        def send(msg: Verdict | ActivationRows) -> Awaitable[None]:
            return self._send(context, msg)
        if not session.trailing_rows:
            return Outbox(send)
        acked = session.acks_rows
        largest = self.limits.max_message_bytes // 2
        part = min(ROWS_PART_BYTES, largest) if acked else largest
        return Outbox(send, lambda verdict: wire.trailing(verdict, INLINE_ACTIVATION_BYTES, part),
                      ROWS_IN_FLIGHT_BYTES if acked else None)

    async def _read(self, context):
        """The next client message as a domain object; None at the end of the stream."""
        try:
            raw = await asyncio.wait_for(context.read(), self.limits.session_idle_timeout_s)
        except asyncio.TimeoutError:
            raise OutOfOrder(f"session idle for {self.limits.session_idle_timeout_s} s; "
                             "closed") from None
        except DecodeError as err:  # grpc parses the bytes on read: corrupt ones end up here
            raise InvalidRequest(f"not a splitdec.v1 ClientMessage: {err}") from None
        if raw is grpc.aio.EOF:
            return None
        self.metrics.received(raw.ByteSize())
        return wire.client_from_proto(raw, self.limits.max_tree_nodes)

    async def _on_model(self, fn: Callable[..., T], *args) -> T:
        return await self._model_thread.run(fn, *args)

    def start_reaper(self) -> None:
        """From now on, on this event loop: drop the orphans idle past the timeout, so an
        abandoned session's KV cache goes even when no new session comes to trigger the
        table's own (lazy) eviction."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_orphans())

    async def _reap_orphans(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.limits.session_idle_timeout_s / 4))
            self.sessions.evict_expired()

    def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._alone):
            task.cancel()
        self._model_thread.shutdown()
