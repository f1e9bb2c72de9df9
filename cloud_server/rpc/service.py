"""The gRPC boundary: protobuf in, domain calls on the model thread, protobuf out.

Thin adapters: each RPC reads its request, opens or resumes the session and hands it to
session_streams.py. Model work never runs on the event loop: it runs on the model thread
(model_thread.py), where the forwards of sessions ready at the same time run as one batch
(batching.py), each session keeping its own KV cache. Domain errors become gRPC status codes in
grpc_status.py.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial
from typing import AsyncIterator, Callable, TypeVar

from cloud_server.decoding.admission import check_protocol
from cloud_server.rpc.artifacts import ArtifactStore
from cloud_server.decoding.batching import Batcher
from cloud_server.rpc.client_stream import ClientStream
from cloud_server.config import ServerConfig
from cloud_server.rpc.drafter_serving import ServedDrafter
from cloud_server.rpc.grpc_status import grpc_status, grpc_status_stream
from cloud_server.rpc.metrics import Metrics
from cloud_server.model_thread import ModelThread
from cloud_server.rpc.security import caller
from cloud_server.decoding.session import Session
from cloud_server.rpc.session_streams import SessionStreams
from cloud_server.decoding.session_table import SessionTable
from cloud_server.target import TargetModel
from shared import wire
from shared.errors import InvalidRequest, NotFound, OutOfOrder, SplitDecodingError
from shared.messages import PROTOCOL_VERSION, OpenRequest, ServerInfo
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

T = TypeVar("T")
CHUNK_BYTES = 256 * 1024


class SplitDecodingService(pb_grpc.SplitDecodingServicer):
    def __init__(self, target: TargetModel, model_thread: ModelThread, config: ServerConfig,
                 artifacts: ArtifactStore, verify_costs: tuple[tuple[int, float], ...] = (),
                 drafter: ServedDrafter | None = None):
        """`verify_costs`: (tree nodes, ms) as measured at start (calibrate.py), for Info;
        `drafter`: the drafter's server half, when one is served."""
        self.target = target
        self.config = config
        self.drafter = drafter
        self.verify_costs = verify_costs
        self.artifacts = artifacts
        self.sessions = SessionTable(config.limits, kv_budget_bytes=config.kv_budget_bytes)
        self._model_thread = model_thread
        self._reaper: asyncio.Task | None = None
        self.metrics = Metrics()
        self.metrics.sessions_open.set_function(lambda: len(self.sessions))
        self.batcher = Batcher(model_thread, target, config.batch_tokens,
                               self.metrics.forwarded)
        self.streams = SessionStreams(self.sessions, self.batcher, config, verify_costs,
                                      target.vocab_size)

    def info(self) -> ServerInfo:
        return ServerInfo(
            protocol_version=PROTOCOL_VERSION, model_id=self.target.model_id,
            tokenizer_sha256=self.artifacts.tokenizer().sha256,
            vocab_size=self.target.vocab_size, stop_token_ids=self.target.stop_token_ids(),
            limits=self.config.limits, artifacts=self.artifacts.listing(),
            verify_costs=self.verify_costs,
            activation_width=0 if self.drafter is None else self.drafter.width,
            draft_graphs=True)

    @grpc_status
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return wire.info_to_proto(self.info())

    @grpc_status_stream
    async def FetchArtifact(self, request: pb.FetchArtifactRequest, context
                            ) -> AsyncIterator[pb.ArtifactChunk]:
        found = self.artifacts.get(request.name)
        if found is None:
            raise NotFound(f"no artifact named {request.name!r}")
        info, data = found
        chunk = min(CHUNK_BYTES, self.config.limits.max_message_bytes // 2)
        for offset in range(0, len(data), chunk):
            yield pb.ArtifactChunk(data=data[offset: offset + chunk], offset=offset,
                                   total_size=len(data), sha256=info.sha256)

    @grpc_status
    async def Decode(self, request_iterator, context) -> None:
        stream = ClientStream(context, self.config.limits, self.metrics)
        opening = await stream.read()
        if opening is None:
            return
        if not isinstance(opening, OpenRequest):
            raise OutOfOrder("no open session on this stream: the first message must be open")
        owner = object()  # this stream, as the session table knows it
        session, resumed = await self._attach(opening, owner, caller(context))
        try:
            # Opened goes first, its prompt ids on the link while the prompt runs (as
            # Generate's): after the prefill they came between the first token and the client
            await stream.send(session.opened(resumed))
            first = (partial(self._on_model, session.catch_up, opening.resume) if resumed
                     else partial(self.batcher.run, session.prefilling(), session.id))
            client = caller(context) or context.peer()
            ended = await self.streams.decode(session, stream, owner, first, client,
                                              opening.rtt_ms)
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
            check_protocol(request)
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
        pace, lead = self.config.pacing.resolve(request.pace, request.lead)
        request = replace(request, pace=pace, lead=lead)
        source = None if self.drafter is None else self.drafter.activations
        session = await self._on_model(Session.open, self.target, self.config.limits, request,
                                        source)
        self.sessions.add(session, owner, session.kv_bytes, by)
        how = "new" if request.resume is None else "rebuilt"
        self.metrics.sessions_opened.labels(how).inc()
        return session

    @grpc_status
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        self.metrics.received(request.ByteSize())
        req = wire.generate_from_proto(request)
        if req.open.resume is not None:
            raise InvalidRequest("generate cannot resume a session; open a new one")
        owner = object()
        session = await self._new_session(req.open, owner)
        stream = ClientStream(context, self.config.limits, self.metrics)
        try:
            await self.streams.server_only(session, stream, req.drafter, req.tree_nodes)
        finally:
            self.batcher.forget(session.id)
            self.sessions.release(session, owner)

    async def _on_model(self, fn: Callable[..., T], *args) -> T:
        return await self._model_thread.run(fn, *args)

    def start_reaper(self) -> None:
        """From now on, on this event loop: drop the orphans idle past the timeout, so an
        abandoned session's KV cache goes even when no new session comes to trigger the
        table's own (lazy) eviction."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_orphans())

    async def _reap_orphans(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.config.limits.session_idle_timeout_s / 4))
            self.sessions.evict_expired()

    def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self.streams.shutdown()
        self._model_thread.shutdown()
