from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArtifactKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_KIND_UNSPECIFIED: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_TOKENIZER: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_DRAFTER_BUNDLE: _ClassVar[ArtifactKind]

class ActivationFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_FORMAT_UNSPECIFIED: _ClassVar[ActivationFormat]
    ACTIVATION_FORMAT_FP16: _ClassVar[ActivationFormat]
    ACTIVATION_FORMAT_INT8: _ClassVar[ActivationFormat]

class AcceptanceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCEPTANCE_MODE_UNSPECIFIED: _ClassVar[AcceptanceMode]
    ACCEPTANCE_MODE_GREEDY: _ClassVar[AcceptanceMode]
    ACCEPTANCE_MODE_TOPK_DRAFTS: _ClassVar[AcceptanceMode]
    ACCEPTANCE_MODE_SAMPLED_DRAFTS: _ClassVar[AcceptanceMode]
    ACCEPTANCE_MODE_EXPONENTIAL_RACE: _ClassVar[AcceptanceMode]

class Pace(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACE_UNSPECIFIED: _ClassVar[Pace]
    PACE_LOCKSTEP: _ClassVar[Pace]
    PACE_SERVER: _ClassVar[Pace]
    PACE_AUTO: _ClassVar[Pace]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]

class Next(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_UNSPECIFIED: _ClassVar[Next]
    NEXT_DRAFT: _ClassVar[Next]
    NEXT_REST: _ClassVar[Next]
ARTIFACT_KIND_UNSPECIFIED: ArtifactKind
ARTIFACT_KIND_TOKENIZER: ArtifactKind
ARTIFACT_KIND_DRAFTER_BUNDLE: ArtifactKind
ACTIVATION_FORMAT_UNSPECIFIED: ActivationFormat
ACTIVATION_FORMAT_FP16: ActivationFormat
ACTIVATION_FORMAT_INT8: ActivationFormat
ACCEPTANCE_MODE_UNSPECIFIED: AcceptanceMode
ACCEPTANCE_MODE_GREEDY: AcceptanceMode
ACCEPTANCE_MODE_TOPK_DRAFTS: AcceptanceMode
ACCEPTANCE_MODE_SAMPLED_DRAFTS: AcceptanceMode
ACCEPTANCE_MODE_EXPONENTIAL_RACE: AcceptanceMode
PACE_UNSPECIFIED: Pace
PACE_LOCKSTEP: Pace
PACE_SERVER: Pace
PACE_AUTO: Pace
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
NEXT_UNSPECIFIED: Next
NEXT_DRAFT: Next
NEXT_REST: Next

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_tree_nodes", "max_tree_depth", "max_prompt_tokens", "max_new_tokens", "max_sessions", "max_message_bytes", "session_idle_timeout_s")
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    max_tree_nodes: int
    max_tree_depth: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_sessions: int
    max_message_bytes: int
    session_idle_timeout_s: int
    def __init__(self, max_tree_nodes: _Optional[int] = ..., max_tree_depth: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., session_idle_timeout_s: _Optional[int] = ...) -> None: ...

class Activations(_message.Message):
    __slots__ = ("start", "rows", "width", "format", "data", "scales")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    width: int
    format: ActivationFormat
    data: bytes
    scales: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., format: _Optional[_Union[ActivationFormat, str]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "kind", "sha256", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ArtifactKind
    sha256: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ArtifactKind, str]] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class VerifyCost(_message.Message):
    __slots__ = ("nodes", "ms")
    NODES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    ms: float
    def __init__(self, nodes: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "model_id", "tokenizer_sha256", "vocab_size", "stop_token_ids", "limits", "artifacts", "verify_costs", "activation_width", "draft_graphs")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    tokenizer_sha256: str
    vocab_size: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    limits: Limits
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    verify_costs: _containers.RepeatedCompositeFieldContainer[VerifyCost]
    activation_width: int
    draft_graphs: bool
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ..., vocab_size: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., verify_costs: _Optional[_Iterable[_Union[VerifyCost, _Mapping]]] = ..., activation_width: _Optional[int] = ..., draft_graphs: _Optional[bool] = ...) -> None: ...

class FetchArtifactRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("data", "offset", "total_size", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_size: int
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("input_ids", "chat", "max_new_tokens", "sampling", "acceptance", "stop_token_ids", "stop_strings", "resume", "activations", "pace", "lead", "protocol_version", "rtt_ms")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    PACE_FIELD_NUMBER: _ClassVar[int]
    LEAD_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    input_ids: TokenIds
    chat: ChatPrompt
    max_new_tokens: int
    sampling: Sampling
    acceptance: AcceptanceMode
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    resume: Resume
    activations: ActivationFormat
    pace: Pace
    lead: int
    protocol_version: int
    rtt_ms: int
    def __init__(self, input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., acceptance: _Optional[_Union[AcceptanceMode, str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., activations: _Optional[_Union[ActivationFormat, str]] = ..., pace: _Optional[_Union[Pace, str]] = ..., lead: _Optional[int] = ..., protocol_version: _Optional[int] = ..., rtt_ms: _Optional[int] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("session_id", "generated_ids", "rows_held")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    rows_held: int
    def __init__(self, session_id: _Optional[str] = ..., generated_ids: _Optional[_Iterable[int]] = ..., rows_held: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("open", "drafter", "tree_nodes")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    open: Open
    drafter: str
    tree_nodes: int
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., drafter: _Optional[str] = ..., tree_nodes: _Optional[int] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("round_id", "base_length", "tokens", "parents", "q", "alias_nodes", "alias_targets", "rows_held")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    ALIAS_NODES_FIELD_NUMBER: _ClassVar[int]
    ALIAS_TARGETS_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    base_length: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[DraftQ]
    alias_nodes: _containers.RepeatedScalarFieldContainer[int]
    alias_targets: _containers.RepeatedScalarFieldContainer[int]
    rows_held: int
    def __init__(self, round_id: _Optional[int] = ..., base_length: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[DraftQ, _Mapping]]] = ..., alias_nodes: _Optional[_Iterable[int]] = ..., alias_targets: _Optional[_Iterable[int]] = ..., rows_held: _Optional[int] = ...) -> None: ...

class DraftQ(_message.Message):
    __slots__ = ("node", "tokens", "probs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    node: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, node: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("open", "draft", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    draft: Draft
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "acceptance", "seed", "resumed", "pace", "lead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    PACE_FIELD_NUMBER: _ClassVar[int]
    LEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    acceptance: AcceptanceMode
    seed: int
    resumed: bool
    pace: Pace
    lead: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., acceptance: _Optional[_Union[AcceptanceMode, str]] = ..., seed: _Optional[int] = ..., resumed: _Optional[bool] = ..., pace: _Optional[_Union[Pace, str]] = ..., lead: _Optional[int] = ...) -> None: ...

class ServerTimings(_message.Message):
    __slots__ = ("queue_ms", "verify_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    verify_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("round_id", "accepted_nodes", "tokens", "committed_length", "finish_reason", "timings", "activations", "draft_id", "more", "next", "draft_nodes")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NODES_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    finish_reason: FinishReason
    timings: ServerTimings
    activations: Activations
    draft_id: int
    more: bool
    next: Next
    draft_nodes: int
    def __init__(self, round_id: _Optional[int] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[ServerTimings, _Mapping]] = ..., activations: _Optional[_Union[Activations, _Mapping]] = ..., draft_id: _Optional[int] = ..., more: _Optional[bool] = ..., next: _Optional[_Union[Next, str]] = ..., draft_nodes: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "rounds")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    generated_tokens: int
    rounds: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("opened", "verdict", "done", "activations")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    verdict: Verdict
    done: Done
    activations: Activations
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., activations: _Optional[_Union[Activations, _Mapping]] = ...) -> None: ...
