"""The server owns a Decode session's pace: before each forward it decides what the Verdict will
tell the client (Verdict.next: draft, or rest) and, after sending it, how long the next forward
waits for the draft it asked for (docs/architecture.md, "Pacing").

Lock-step asks for a draft every time and waits for it; server pace asks every time and never
waits; auto pace asks, and waits, only while a draft is worth its wait (`AutoPace`). A session
with no client behind it (Generate, a stream that broke) asks nothing. Runs on the event loop;
knows nothing of gRPC or of the model.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from cloud_server.rpc.stream_buffers import Inbox
from shared.drafting.base import DrafterName
from shared.messages import Next, Pace
from shared.moving_average import ema


@dataclass(frozen=True)
class PacingPolicy:
    """The server's side of pacing: what a session gets when its Open leaves pace or lead
    unset, the most lead it may ask for, the drafter the server runs for its own candidates
    (None: a forward without client candidates is a plain decoding step), and whether `auto`
    waits longer for drafts while other sessions have work queued."""

    pace: Pace = Pace.LOCKSTEP
    # Covers the client's acknowledgements queued behind a prompt's rows on a slow link
    # (results log, `pacing_notes`); a dead link costs at most this many tokens of forwards,
    # and they are kept for a resume.
    lead: int = 128
    max_lead: int = 256
    # Token Recycling: it drafts best of the server's own drafters (results log, `recycle_tau`)
    drafter: DrafterName | None = DrafterName.RECYCLE
    load_wait: bool = True

    def resolve(self, pace: Pace | None, lead: int) -> tuple[Pace, int]:
        """The session's pace and lead, from what its Open asked (None, 0: the defaults)."""
        return pace or self.pace, min(lead or self.lead, self.max_lead)


EMA_WEIGHT = 0.2  # AutoPace's running means: about the last five forwards (or replies) count
LOADED_WAIT_STEPS = 4  # under load: the longest wait for a draft that adds tokens, in steps
# What AutoPace assumes a forward commits with a draft and alone before it has measured any
# (protocol 1's priors); the first is worth PRIOR_FORWARDS measured forwards
PRIOR_GAIN_WITH, PRIOR_GAIN_ALONE = 2.0, 1.2
# The most a draft is expected to commit at best, for deciding whether a probe could ever pay:
# MoA, the best drafter measured, averaged 2.42 a forward and 2.86 on its best set with trees
# of up to 64 nodes (results log, `moa_tau_q4`)
GAIN_CEILING = 3.0
# Forwards at rest before asking for a draft again; doubles with each probe, up to a few
# generations' worth: a probe brings every row the rest held back
PROBE_GAP, MAX_PROBE_GAP = 8, 256
PRIOR_FORWARDS = 2


class PaceRule:
    """What the Verdict of the coming forward tells the client (`decide`), how long the forward
    after it waits for the answer (`wait`), and what the rule learns from each forward and
    send. The base is a session with no client: it asks nothing and waits for nothing."""

    def decide(self, busy: bool) -> Next | None:
        """Before a forward: what its Verdict tells the client; `busy`: other sessions have
        work queued."""
        return None

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        """Before a forward at `committed` tokens."""

    def forwarded(self, tokens: int, alone: int | None, drafted: bool) -> None:
        """A forward committed `tokens`, `alone` of them the server's own candidates would
        have (None: unknown); `drafted`: it verified a client draft."""

    def sent(self, committed: int, told: Next | None, now: float) -> None:
        """The Verdict that made `committed` went out at monotonic `now`, telling `told`."""


class ServerPace(PaceRule):
    """Server pace: every Verdict asks for a draft, and no forward waits for one."""

    def decide(self, busy: bool) -> Next | None:
        return Next.DRAFT


class Lockstep(ServerPace):
    """Every forward waits for the client's answer to the latest Verdict (a resume's catch-up
    may bring the client no token, so an answer is a new message, not a length)."""

    def __init__(self) -> None:
        self._answered = 0  # the client's messages the forwards so far answered

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        await inbox.wait(lambda: inbox.answers > self._answered, None)
        self._answered = inbox.answers


class PaceMemory:
    """What auto pace learned of each client's link and drafts, kept for its next session
    (the `size` clients seen last): learning afresh would cost every generation its waits
    and the prompt's rows, as a probe does."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._learned: OrderedDict[str, AutoPace] = OrderedDict()

    def rule(self, client: str, pace: Pace, rtt_s: float | None, step_s: float) -> PaceRule:
        """The rule of `client`'s Decode session at `pace`; `rtt_s`: its round trip as its
        Open said (None: unknown); `step_s`: the server's calibrated step, until measured."""
        if pace is Pace.LOCKSTEP:
            return Lockstep()
        if pace is Pace.SERVER:
            return ServerPace()
        learned = self._learned.get(client)
        if learned is None:
            return AutoPace(step_s, rtt_s)
        return replace(learned, _sent={}, _last_sent=None, _waited=0.0)  # a new session

    def keep(self, client: str, rule: PaceRule) -> None:
        if isinstance(rule, AutoPace):
            self._learned[client] = rule
            self._learned.move_to_end(client)
            while len(self._learned) > self.size:
                self._learned.popitem(last=False)


@dataclass
class AutoPace(PaceRule):
    """Asks for a draft, and waits for it, while that pays.

    A round (Verdict sent to Verdict sent, its wait left out: the forward and all the session's
    own work around it, rows and messages included) on a client draft commits `gain_with`
    tokens in `with_s`; one on the server's own candidates `gain_alone` in `step_s`, measured
    in the same forwards where a draft was merged (the forwards a draft comes for are no fair
    sample: results log, `latency_paired`). A wait
    w pays while gain_with / (w + with_s) >= gain_alone / step_s; under load, where a forward
    is the scarce resource and a wait costs the others nothing, any draft that adds tokens is
    worth LOADED_WAIT_STEPS steps. Where the client's replies (`reply_s`, from its Open's round
    trip until measured) come within that, the Verdict says draft and the next forward waits
    for the answer; otherwise it says rest, and after PROBE_GAP forwards at rest, doubling,
    asks once again (a probe, waited for as a draft of GAIN_CEILING tokens would be), unless
    even such a draft could not pay the reply time.
    """

    step_s: float
    reply_s: float | None = None  # Verdict sent -> the client's first answer to it
    with_s: float | None = None
    gain_with: float = PRIOR_GAIN_WITH
    gain_alone: float = PRIOR_GAIN_ALONE
    measured: int = 0  # forwards on a client draft since the session began
    at_rest: int = 0  # forwards since the last that asked for a draft
    probe_gap: int = PROBE_GAP
    _asked: float = 0.0  # the allowance the latest decision asked for a draft with
    _drafted: bool = False  # the latest forward verified a client draft
    _last_sent: float | None = None  # when the latest Verdict went out
    _waited: float = 0.0  # how long this round waited for the client
    # committed length -> (sent at, what its Verdict told, the allowance asked with)
    _sent: dict[int, tuple[float, Next | None, float]] = field(default_factory=dict)

    def decide(self, busy: bool) -> Next:
        reply = self.reply_s or 0.0
        self._asked = self.allowance_s(busy, self.gain_with)
        if reply <= self._asked:
            self.at_rest, self.probe_gap = 0, PROBE_GAP
            return Next.DRAFT
        self.at_rest += 1
        self._asked = self.allowance_s(busy, max(GAIN_CEILING, self.gain_with))
        if self.at_rest > self.probe_gap and reply <= self._asked:
            self.at_rest, self.probe_gap = 0, min(MAX_PROBE_GAP, 2 * self.probe_gap)
            return Next.DRAFT
        return Next.REST

    def allowance_s(self, busy: bool, gain_with: float) -> float:
        """The longest wait for a draft committing `gain_with` tokens that pays."""
        if gain_with <= self.gain_alone:
            return -1.0
        if busy:
            return LOADED_WAIT_STEPS * self.step_s
        return gain_with / self.gain_alone * self.step_s - (self.with_s or self.step_s)

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        """Waits for the draft the latest Verdict asked for, within the allowance it was asked
        with (a probe's: what a draft of GAIN_CEILING tokens would be worth), so that the
        draft is measured."""
        sent_at, told, allowance = self._sent.get(committed, (0.0, None, 0.0))
        if told is Next.DRAFT and inbox.acked < committed:
            start = time.monotonic()
            await inbox.wait(lambda: inbox.acked >= committed, sent_at + allowance - start)
            self._waited = time.monotonic() - start
        self._answered(inbox.acked, inbox.acked_at)

    def _answered(self, acked: int, at: float) -> None:
        """The client has acknowledged length `acked` at `at`: its reply time to that Verdict
        is measured, and older Verdicts forgotten."""
        sent = self._sent.get(acked)
        if sent is not None:
            self.reply_s = ema(self.reply_s, at - sent[0], EMA_WEIGHT)
            self._sent = {n: s for n, s in self._sent.items() if n > acked}

    def forwarded(self, tokens: int, alone: int | None, drafted: bool) -> None:
        """The prior counts as PRIOR_FORWARDS forwards on a draft, and the first measured
        ones evenly with it until the running mean's weight takes over, so that one unlucky
        draft does not end the drafting (results log, `latency_paired`)."""
        self._drafted = drafted
        if drafted:
            self.measured += 1
            self.gain_with = ema(self.gain_with, tokens, self._weight())
        if alone is not None:  # a forward commits its own token at least
            self.gain_alone = ema(self.gain_alone, max(1, alone), EMA_WEIGHT)

    def _weight(self) -> float:
        return max(EMA_WEIGHT, 1 / (self.measured + PRIOR_FORWARDS))

    def sent(self, committed: int, told: Next | None, now: float) -> None:
        """Times the round that made the Verdict, its wait left out."""
        if self._last_sent is not None:
            round_s = now - self._last_sent - self._waited
            if self._drafted:
                self.with_s = ema(self.with_s, round_s, self._weight())
            else:
                self.step_s = ema(self.step_s, round_s, EMA_WEIGHT)
        self._sent[committed] = (now, told, self._asked)
        self._last_sent, self._waited = now, 0.0
