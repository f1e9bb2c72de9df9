"""The wire codec: protobuf messages <-> domain types. The one module that touches both."""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Generic, TypeVar

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.activation_codec import from_int8, to_int8
from shared.draft_q import NodeQ
from shared.errors import InvalidRequest
from shared.draft_graph import DraftGraph, fold
from shared.messages import (
    ActivationFormat, ActivationRows, ArtifactInfo, ArtifactKind, ChatMessage, ClientMessage,
    CloseRequest, Done, DraftRequest, FinishReason, GenerateRequest, Limits, OpenRequest, Opened,
    Next, Pace, Resume, ServerInfo, ServerMessage, Verdict,
)
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.sampling import SamplingParams
from shared.tree import DraftTree

E = TypeVar("E", bound=Enum)

_LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)


@dataclass(frozen=True)
class _EnumWire(Generic[E]):
    """A domain enum and the protobuf enum that carries it: member NAME travels as PREFIX_NAME,
    and None as PREFIX_UNSPECIFIED (0)."""

    domain: type[E]
    proto: Any  # the generated EnumTypeWrapper
    prefix: str


ACCEPTANCE = _EnumWire(AcceptanceMode, pb.AcceptanceMode, "ACCEPTANCE_MODE")
ACTIVATIONS = _EnumWire(ActivationFormat, pb.ActivationFormat, "ACTIVATION_FORMAT")
PACE = _EnumWire(Pace, pb.Pace, "PACE")
NEXT = _EnumWire(Next, pb.Next, "NEXT")


def _to_proto(wire: _EnumWire[E], value: E | None) -> str:
    return f"{wire.prefix}_{'UNSPECIFIED' if value is None else value.name}"


def _from_proto(wire: _EnumWire[E], value: int) -> E | None:
    """The domain value; a number this version does not know (proto3 keeps it) is refused."""
    try:
        name = wire.proto.Name(value).removeprefix(wire.prefix + "_")
    except ValueError:
        raise InvalidRequest(f"unknown {wire.prefix.lower()} value {value}") from None
    return None if name == "UNSPECIFIED" else wire.domain[name]


def info_to_proto(info: ServerInfo) -> pb.InfoResponse:
    return pb.InfoResponse(
        protocol_version=info.protocol_version,
        model_id=info.model_id,
        tokenizer_sha256=info.tokenizer_sha256,
        vocab_size=info.vocab_size,
        stop_token_ids=info.stop_token_ids,
        limits=pb.Limits(**{f: getattr(info.limits, f) for f in _LIMIT_FIELDS}),
        artifacts=[
            pb.Artifact(name=a.name, kind=pb.ArtifactKind.Name(a.kind.value), sha256=a.sha256,
                        size_bytes=a.size_bytes)
            for a in info.artifacts
        ],
        verify_costs=[pb.VerifyCost(nodes=n, ms=ms) for n, ms in info.verify_costs],
        activation_width=info.activation_width, draft_graphs=info.draft_graphs,
    )


def info_from_proto(msg: pb.InfoResponse) -> ServerInfo:
    return ServerInfo(
        protocol_version=msg.protocol_version,
        model_id=msg.model_id,
        tokenizer_sha256=msg.tokenizer_sha256,
        vocab_size=msg.vocab_size,
        stop_token_ids=tuple(msg.stop_token_ids),
        limits=Limits(**{f: getattr(msg.limits, f) for f in _LIMIT_FIELDS}),
        artifacts=tuple(
            ArtifactInfo(a.name, ArtifactKind(a.kind), a.sha256, a.size_bytes)
            for a in msg.artifacts
        ),
        verify_costs=tuple((c.nodes, c.ms) for c in msg.verify_costs),
        activation_width=msg.activation_width, draft_graphs=msg.draft_graphs,
    )


def _open_to_proto(msg: OpenRequest) -> pb.Open:
    open_msg = pb.Open(max_new_tokens=msg.max_new_tokens,
                       sampling=_sampling_to_proto(msg.sampling),
                       acceptance=_to_proto(ACCEPTANCE, msg.acceptance),
                       stop_token_ids=msg.stop_token_ids, stop_strings=msg.stop_strings,
                       activations=_to_proto(ACTIVATIONS, msg.activations),
                       pace=_to_proto(PACE, msg.pace), lead=msg.lead,
                       protocol_version=msg.protocol_version, rtt_ms=msg.rtt_ms)
    if msg.chat is not None:
        open_msg.chat.messages.extend(
            pb.ChatMessage(role=m.role, content=m.content) for m in msg.chat)
    else:
        open_msg.input_ids.ids.extend(msg.prompt_ids or ())
    if msg.resume is not None:
        open_msg.resume.CopyFrom(pb.Resume(session_id=msg.resume.session_id,
                                           generated_ids=msg.resume.generated_ids,
                                           rows_held=msg.resume.rows_held))
    return open_msg


def generate_to_proto(msg: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(open=_open_to_proto(msg.open), drafter=msg.drafter or "",
                              tree_nodes=msg.tree_nodes)


def generate_from_proto(msg: pb.GenerateRequest) -> GenerateRequest:
    if not msg.HasField("open"):
        raise InvalidRequest("generate request has no open")
    return GenerateRequest(_open_from_proto(msg.open), msg.drafter or None, msg.tree_nodes)


def client_to_proto(msg: ClientMessage, graphs: bool = False) -> pb.ClientMessage:
    """`graphs`: a draft may travel as a draft graph (draft_to_proto); only to a server that
    says it unrolls them (ServerInfo.draft_graphs)."""
    if isinstance(msg, OpenRequest):
        return pb.ClientMessage(open=_open_to_proto(msg))
    if isinstance(msg, DraftRequest):
        return pb.ClientMessage(draft=draft_to_proto(msg, graphs))
    return pb.ClientMessage(close=pb.Close())


def draft_to_proto(msg: DraftRequest, graphs: bool) -> pb.Draft:
    """With `graphs`, a tree in breadth-first order travels as its draft graph (each repeated
    subtree once, shared/draft_graph.py); a tree with q always travels as it is."""
    graph = fold(msg.tree) if graphs and not msg.q else DraftGraph(msg.tree)
    aliases = list(zip(*graph.aliases)) or [(), ()]
    return pb.Draft(round_id=msg.round_id, base_length=msg.base_length,
                    tokens=graph.tree.tokens, parents=graph.tree.parents,
                    q=[pb.DraftQ(node=q.node, tokens=q.tokens, probs=q.probs) for q in msg.q],
                    alias_nodes=aliases[0], alias_targets=aliases[1], rows_held=msg.rows_held)


def client_from_proto(msg: pb.ClientMessage, max_tree_nodes: int) -> ClientMessage:
    """A draft graph comes back unrolled into its tree, cut after `max_tree_nodes` nodes."""
    kind = msg.WhichOneof("kind")
    if kind == "open":
        return _open_from_proto(msg.open)
    if kind == "draft":
        d = msg.draft
        q = tuple(NodeQ(q.node, tuple(q.tokens), tuple(q.probs)) for q in d.q)
        return DraftRequest(d.round_id, d.base_length, _unrolled(d, bool(q), max_tree_nodes), q,
                            d.rows_held if d.HasField("rows_held") else None)
    if kind == "close":
        return CloseRequest()
    raise InvalidRequest("client message has no open, draft or close")


def _unrolled(d: pb.Draft, has_q: bool, max_nodes: int) -> DraftTree:
    tree = DraftTree(tuple(d.tokens), tuple(d.parents))
    if not d.alias_nodes and not d.alias_targets:
        return tree
    if len(d.alias_nodes) != len(d.alias_targets):
        raise InvalidRequest(f"draft has {len(d.alias_nodes)} alias nodes but "
                             f"{len(d.alias_targets)} alias targets")
    if has_q:
        raise InvalidRequest("a draft with q must be a plain tree: its q names tree nodes")
    graph = DraftGraph(tree, tuple(zip(d.alias_nodes, d.alias_targets)))
    graph.validate(max_nodes)
    return graph.unrolled(max_nodes)


def _open_from_proto(msg: pb.Open) -> OpenRequest:
    common: dict[str, Any] = dict(max_new_tokens=msg.max_new_tokens, sampling=_sampling_from_proto(msg.sampling),
                  acceptance=_from_proto(ACCEPTANCE, msg.acceptance),
                  stop_token_ids=tuple(msg.stop_token_ids), stop_strings=tuple(msg.stop_strings),
                  resume=_resume_from_proto(msg.resume) if msg.HasField("resume") else None,
                  activations=_from_proto(ACTIVATIONS, msg.activations),
                  pace=_from_proto(PACE, msg.pace), lead=msg.lead,
                  protocol_version=msg.protocol_version, rtt_ms=msg.rtt_ms)
    which = msg.WhichOneof("prompt")
    if which == "chat":
        return OpenRequest(chat=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages),
                           **common)
    if which == "input_ids":
        return OpenRequest(prompt_ids=tuple(msg.input_ids.ids), **common)
    raise InvalidRequest("open has no prompt: set input_ids or chat")


def _resume_from_proto(msg: pb.Resume) -> Resume:
    return Resume(msg.session_id, tuple(msg.generated_ids),
                  msg.rows_held if msg.HasField("rows_held") else None)


def _sampling_to_proto(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       seed=params.seed)


def _sampling_from_proto(msg: pb.Sampling) -> SamplingParams:
    try:
        return SamplingParams(temperature=msg.temperature, top_k=msg.top_k,
                              top_p=msg.top_p if msg.top_p > 0 else 1.0,
                              seed=msg.seed if msg.HasField("seed") else None)
    except ValueError as err:
        raise InvalidRequest(f"sampling: {err}") from None


def server_to_proto(msg: ServerMessage) -> pb.ServerMessage:
    if isinstance(msg, Opened):
        return pb.ServerMessage(opened=pb.Opened(
            session_id=msg.session_id, prompt_ids=msg.prompt_ids,
            acceptance=_to_proto(ACCEPTANCE, msg.acceptance), seed=msg.seed,
            resumed=msg.resumed, pace=_to_proto(PACE, msg.pace), lead=msg.lead))
    if isinstance(msg, ActivationRows):
        return pb.ServerMessage(activations=_activations_to_proto(msg))
    if isinstance(msg, Verdict):
        verdict = pb.Verdict(
            round_id=msg.round_id, accepted_nodes=msg.accepted_nodes, tokens=msg.tokens,
            committed_length=msg.committed_length,
            finish_reason=pb.FinishReason.Name(msg.finish_reason.value),
            timings=pb.ServerTimings(queue_ms=msg.queue_ms, verify_ms=msg.verify_ms),
            draft_id=msg.draft_id, more=msg.more, next=_to_proto(NEXT, msg.next),
            draft_nodes=msg.draft_nodes)
        if msg.activations is not None:
            verdict.activations.CopyFrom(_activations_to_proto(msg.activations))
        return pb.ServerMessage(verdict=verdict)
    return pb.ServerMessage(done=pb.Done(
        finish_reason=pb.FinishReason.Name(msg.finish_reason.value),
        generated_tokens=msg.generated_tokens,
        rounds=msg.rounds))


def verdict_parts(verdict: Verdict, max_bytes: int) -> list[Verdict]:
    """`verdict` as messages of at most about `max_bytes` of activations each: the first parts
    carry consecutive rows and no tokens (`more` set), the last the rest and everything else.
    join_parts is the inverse."""
    rows = verdict.activations
    if rows is None:
        return [verdict]
    per_part = max(1, max_bytes // row_bytes(rows))
    n = len(rows.values)
    if n <= per_part:
        return [verdict]
    cuts = list(range(0, n, per_part))
    base = verdict.base_length
    parts = [Verdict(verdict.round_id, (), (), base, queue_ms=verdict.queue_ms,
                     activations=_slice(rows, a, a + per_part), more=True) for a in cuts[:-1]]
    return [*parts, replace(verdict, activations=_slice(rows, cuts[-1], n))]


def trailing(verdict: Verdict, inline_bytes: int, max_bytes: int) -> list[Verdict | ActivationRows]:
    """A paced session's `verdict` as sent: its activations inside it when they take at most
    `inline_bytes`, else the Verdict alone, then its rows in messages of at most about
    `max_bytes` each, so that its tokens do not queue behind them on the link. A Verdict that
    ends the generation goes alone: nobody drafts past it."""
    rows = verdict.activations
    if rows is None or rows_bytes(rows) <= inline_bytes:
        return [verdict]
    head = replace(verdict, activations=None)
    if verdict.finish_reason is not FinishReason.NOT_FINISHED:
        return [head]
    per_part = max(1, max_bytes // row_bytes(rows))
    return [head, *(_slice(rows, a, a + per_part) for a in range(0, len(rows.values), per_part))]


def join_parts(parts: list[Verdict]) -> Verdict:
    """One Verdict from its parts (the last has no `more`), activations concatenated."""
    last = parts[-1]
    if len(parts) == 1:
        return last
    rows = [p.activations for p in parts if p.activations is not None]
    values = np.concatenate([r.values for r in rows])  # [rows, width]
    return replace(last, activations=ActivationRows(rows[0].start, values, rows[0].format))


def row_bytes(rows: ActivationRows) -> int:
    """What one of `rows` takes on the wire."""
    width = rows.values.shape[1]
    return width + 2 if rows.format is ActivationFormat.INT8 else 2 * width


def rows_bytes(rows: ActivationRows) -> int:
    return row_bytes(rows) * len(rows.values)


def _slice(rows: ActivationRows, start: int, end: int) -> ActivationRows:
    return ActivationRows(rows.start + start, rows.values[start:end], rows.format)


def _activations_to_proto(rows: ActivationRows) -> pb.Activations:
    """fp16 values, or int8 values with one fp16 scale per row (shared/activation_codec.py)."""
    n, width = rows.values.shape
    msg = pb.Activations(start=rows.start, rows=n, width=width,
                         format=_to_proto(ACTIVATIONS, rows.format))
    if rows.format is ActivationFormat.INT8:
        values, scales = to_int8(rows.values)
        msg.data, msg.scales = values.tobytes(), scales.astype("<f2").tobytes()
    else:
        msg.data = np.asarray(rows.values, dtype="<f2").tobytes()
    return msg


def _activations_from_proto(msg: pb.Activations) -> ActivationRows:
    fmt = _from_proto(ACTIVATIONS, msg.format)
    if fmt is None:
        raise ValueError("activations without a format")
    shape = (msg.rows, msg.width)
    value_bytes = 1 if fmt is ActivationFormat.INT8 else 2
    if len(msg.data) != msg.rows * msg.width * value_bytes:
        raise ValueError(f"activations of {msg.rows} x {msg.width} carry {len(msg.data)} bytes")
    if fmt is ActivationFormat.INT8:
        values = np.frombuffer(msg.data, dtype=np.int8).reshape(shape)
        scales = np.frombuffer(msg.scales, dtype="<f2").reshape(msg.rows)
        return ActivationRows(msg.start, from_int8(values, scales), fmt)
    values = np.frombuffer(msg.data, dtype="<f2").reshape(shape)
    return ActivationRows(msg.start, values.astype(np.float32), fmt)


def _next_from_proto(value: int) -> Next | None:
    """A Verdict's `next`; one this client does not know is a protocol error (ValueError),
    never a guess at what the server wants."""
    try:
        return _from_proto(NEXT, value)
    except InvalidRequest as err:
        raise ValueError(f"{err}: the server speaks a newer protocol") from None


def server_from_proto(msg: pb.ServerMessage) -> ServerMessage:
    kind = msg.WhichOneof("kind")
    if kind == "opened":
        o = msg.opened
        acceptance = _from_proto(ACCEPTANCE, o.acceptance) or AcceptanceMode.GREEDY
        return Opened(o.session_id, tuple(o.prompt_ids), acceptance, o.seed,
                      o.resumed, _from_proto(PACE, o.pace) or Pace.LOCKSTEP, o.lead)
    if kind == "verdict":
        v = msg.verdict
        return Verdict(v.round_id, tuple(v.accepted_nodes), tuple(v.tokens), v.committed_length,
                       FinishReason(v.finish_reason), v.timings.queue_ms, v.timings.verify_ms,
                       _activations_from_proto(v.activations) if v.HasField("activations")
                       else None, v.draft_id, v.more, _next_from_proto(v.next), v.draft_nodes)
    if kind == "done":
        d = msg.done
        return Done(FinishReason(d.finish_reason), d.generated_tokens, d.rounds)
    if kind == "activations":
        return _activations_from_proto(msg.activations)
    raise ValueError("server message has no opened, verdict, done or activations")
