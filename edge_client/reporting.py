"""What a generation reports: its result and stats when it ends (GenerationResult, with what
became of a paced session's drafts: DraftOutcomes), and what a front end sees as it happens
(Listener).

Shared by every way the edge generates: split decoding (generate.py) and the server-only
baselines (server_only.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.messages import FinishReason, Pace


@dataclass
class DraftOutcomes:
    """What became of the drafts a paced generation sent, as the edge learns it: verified by a
    forward (`used`; `earned` of them got a node accepted), passed by the server before any
    forward could use them though its text followed them as far as it went (`late`: on time,
    each would have offered right tokens), or left by the text at their first token (`wrong`).
    A draft still live when the generation ends or its stream breaks is none of these. On a
    slow link `late` is what the round trip costs; `wrong` is the drafter's."""

    used: int = 0
    earned: int = 0
    late: int = 0
    wrong: int = 0

    @property
    def settled(self) -> int:
        return self.used + self.late + self.wrong


@dataclass
class GenerationResult:
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # committed: verified by the target
    rounds: int = 0  # draft rounds; the prefill is not one
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # From the request to the answer complete (Done): the close handshake after it, a round
    # trip on a paced stream, is not the user's wait (a server-only stream ends with Done)
    wall_s: float = 0.0
    ttft_s: float = 0.0
    bytes_up: int = 0
    messages_up: int = 0  # on Decode streams: Opens, Drafts (acknowledgements too), Closes
    bytes_down: int = 0
    verify_s: float = 0.0  # the server's own time verifying, as its Verdicts report
    prefill_s: float = 0.0  # the part of it that answered an Open: the prefill (and a resume's)
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    draft_s: float = 0.0  # drafting the edge waited for
    hidden_draft_s: float = 0.0  # drafting done while a round was in flight, and used
    speculations: int = 0
    speculation_hits: int = 0
    reconnects: int = 0
    rebuilt_sessions: int = 0  # resumes the server answered from history (it lost the session)
    outage_s: float = 0.0  # time without a working link
    offline_tokens: int = 0  # drafted while the link was down
    kept_tokens: int = 0  # offline tokens the target's own text confirmed
    corrected_tokens: int = 0  # offline tokens the target disagreed with, rewound
    unverified_ids: list[int] = field(default_factory=list)  # kept unverified (policy keep)
    server_only: bool = False  # a baseline: one server-streaming call, no drafts (server_only.py)
    rtt_s: float = 0.0  # the link's round trip, from the first Open (the server's own time off)
    # Split decoding: the pace the session ran, as Opened said (PacingPolicy.resolve)
    pace: Pace | None = None
    drafts: DraftOutcomes = field(default_factory=DraftOutcomes)  # paced sessions only

    @property
    def tau(self) -> float:
        """Mean tokens committed per draft round (accepted drafts + the target's token)."""
        return (len(self.output_ids) - 1) / self.rounds if self.rounds else 0.0

    @property
    def server_calls(self) -> int:
        """Messages the edge sent the server: a baseline's one request, or everything sent on
        the Decode streams (in lock-step an Open, one Draft a round and a Close; paced, an
        edge the server told to rest answers only now and then, edge_client/paced_drafts.py)."""
        return 1 if self.server_only else self.messages_up

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.wall_s if self.wall_s else 0.0


class Listener(Protocol):
    """What a front end sees of a generation as it happens."""

    def committed(self, ids: list[int]) -> None: ...

    def unverified(self, ids: list[int]) -> None:
        """Offline drafts, to be shown apart from committed text."""

    def withdraw(self) -> None:
        """The unverified text shown so far is void; committed() follows with the truth."""

    def link_event(self, text: str) -> None: ...


class SilentListener:
    def committed(self, ids: list[int]) -> None: ...

    def unverified(self, ids: list[int]) -> None: ...

    def withdraw(self) -> None: ...

    def link_event(self, text: str) -> None: ...
