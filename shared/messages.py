"""Domain types of the protocol: what both sides reason about, free of protobuf.

`shared/wire.py` is the only place these meet the generated protobuf classes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from shared.acceptance import AcceptanceMode
from shared.draft_q import NodeQ
from shared.sampling import SamplingParams
from shared.tree import DraftTree

PROTOCOL_VERSION = 2  # Open.protocol_version: 2 since the server owns the pace


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    STOP_TOKEN = 1
    LENGTH = 2
    CONTEXT = 3
    STOP_STRING = 4


class ArtifactKind(enum.Enum):
    TOKENIZER = 1
    DRAFTER_BUNDLE = 2


TOKENIZER_ARTIFACT = "tokenizer.json"  # the name Info lists the target's tokenizer under


class Pace(enum.Enum):
    """Who paces a Decode session's forwards (docs/architecture.md, "Pacing")."""

    LOCKSTEP = "lockstep"  # one forward per client draft, verified at its base
    SERVER = "server"  # never wait: the freshest draft re-rooted, plus the server's candidates
    AUTO = "auto"  # as server, waiting for a draft in flight while that is worth it


class Next(enum.Enum):
    """What a Decode Verdict tells the client to do next (docs/architecture.md, "Pacing")."""

    DRAFT = 1  # answer with a draft from this Verdict (or an ack if the last one still fits)
    REST = 2  # draft nothing; acknowledge only as the lead needs


class ActivationFormat(enum.Enum):
    FP16 = 1
    INT8 = 2


@dataclass(frozen=True)
class ActivationRows:
    """The server half's output for committed positions start, start + 1, ... (docs/architecture.md, Drafters)."""

    start: int
    values: np.ndarray = field(compare=False)  # [rows, width]
    format: ActivationFormat = ActivationFormat.FP16


@dataclass(frozen=True)
class Limits:
    max_tree_nodes: int = 128
    max_tree_depth: int = 64  # an offline stretch of up to 64 tokens is checked in one round
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 2048
    max_sessions: int = 16
    max_message_bytes: int = 4 * 1024 * 1024
    session_idle_timeout_s: int = 300


@dataclass(frozen=True)
class ArtifactInfo:
    name: str
    kind: ArtifactKind
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class ServerInfo:
    protocol_version: int
    model_id: str
    tokenizer_sha256: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    limits: Limits
    artifacts: tuple[ArtifactInfo, ...]
    verify_costs: tuple[tuple[int, float], ...] = ()  # (tree nodes, ms), nodes ascending
    activation_width: int = 0  # 0: the server computes no activations (no drafter bundle)
    draft_graphs: bool = False  # the server unrolls draft graphs (shared/draft_graph.py)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Resume:
    """The edge's committed history when it continues a generation on a new stream."""

    session_id: str
    generated_ids: tuple[int, ...]
    rows_held: int | None = None  # activation rows the edge holds (None: all it could)


@dataclass(frozen=True)
class OpenRequest:
    """Exactly one of `prompt_ids` (used as given) and `chat` (templated by the server).
    `acceptance` None lets the server choose: greedy when not sampling. With `resume`, the
    prompt, seed and acceptance must be those Opened answered the first time."""

    prompt_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None
    max_new_tokens: int = 0
    sampling: SamplingParams = SamplingParams()
    acceptance: AcceptanceMode | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    resume: Resume | None = None
    activations: ActivationFormat | None = None  # a drafter fed by the server half asks
    pace: Pace | None = None  # None: the server's default
    lead: int = 0  # tokens the server may run past the client's acknowledgement; 0: default
    protocol_version: int = PROTOCOL_VERSION  # the server refuses any other
    rtt_ms: int = 0  # the client's latest round trip to the server (0: unknown)


@dataclass(frozen=True)
class GenerateRequest:
    """A server-only generation (the baselines): `drafter` None decodes token by token."""

    open: OpenRequest
    drafter: str | None = None
    tree_nodes: int = 0


@dataclass(frozen=True)
class DraftRequest:
    round_id: int
    base_length: int
    tree: DraftTree
    q: tuple[NodeQ, ...] = ()  # acceptance sampled-drafts only
    rows_held: int | None = None  # activation rows the edge holds (row flow control)


@dataclass(frozen=True)
class CloseRequest:
    pass


@dataclass(frozen=True)
class Opened:
    session_id: str
    prompt_ids: tuple[int, ...]
    acceptance: AcceptanceMode = AcceptanceMode.GREEDY
    seed: int = 0
    resumed: bool = False  # the session outlived a broken stream and continues in place
    pace: Pace = Pace.LOCKSTEP
    lead: int = 0


@dataclass(frozen=True)
class Verdict:
    round_id: int
    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]  # accepted drafts then the target's own token
    committed_length: int
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    queue_ms: float = 0.0
    verify_ms: float = 0.0
    activations: ActivationRows | None = None
    # Paced sessions: the client draft whose nodes this forward verified (0: none);
    # accepted_nodes index it re-rooted at this Verdict's base (shared/rerooting.py).
    draft_id: int = 0
    more: bool = False  # a part: the next Verdict continues its activations (wire.py)
    next: Next | None = None  # Decode sessions: what the client does next (None: Generate)
    draft_nodes: int = 0  # paced, with next DRAFT: the most nodes a forward verifies of it

    @property
    def base_length(self) -> int:
        """The committed length this Verdict continues."""
        return self.committed_length - len(self.tokens)


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    generated_tokens: int
    rounds: int


ClientMessage = OpenRequest | DraftRequest | CloseRequest
ServerMessage = Opened | Verdict | Done | ActivationRows  # rows: paced sessions (wire.py)
