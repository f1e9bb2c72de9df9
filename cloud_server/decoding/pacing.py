"""The server owns a Decode session's pace: before each forward it decides what the Verdict tells
the client (Verdict.next: draft, or rest), and after it how long the next forward waits for the
draft it asked for (docs/architecture.md, "Pacing"). Lock-step asks every time and waits; server
pace asks and never waits; auto asks, and waits, while a draft is worth its wait (`AutoPace`).
Its defaults: config.PacingPolicy. Runs on the event loop; knows nothing of gRPC or the model.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from cloud_server.rpc.stream_buffers import Inbox
from shared.messages import Next, Pace
from shared.moving_average import ema

EMA_WEIGHT = 0.2  # AutoPace's running means: about the last five forwards (or replies) count
LOADED_WAIT_STEPS = 4  # under load: the longest wait for a draft that adds tokens, in steps
# Tokens a forward commits with a draft and alone, assumed until measured (protocol 1's priors);
# the first is worth PRIOR_FORWARDS measured forwards
PRIOR_GAIN_WITH, PRIOR_GAIN_ALONE, PRIOR_FORWARDS = 2.0, 1.2, 2
# The most a draft commits at best, for whether a probe could ever pay: MoA averaged 2.42 a
# forward, 2.86 on its best set (results log, `moa_tau_q4`)
GAIN_CEILING = 3.0
# Forwards at rest before asking again; doubles with each probe (a probe brings every row the
# rest held back), up to a few generations' worth
PROBE_GAP, MAX_PROBE_GAP = 8, 256


class PaceRule:
    """A session with no client: it asks nothing and waits for nothing. Rules with a client
    say what the coming forward's Verdict tells it, how long the next forward waits for the
    answer, and learn from each forward and send."""

    def decide(self, busy: bool) -> Next | None:
        """Before a forward; `busy`: other sessions have work queued."""
        return None

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        """Before a forward at `committed` tokens."""

    def forwarded(self, tokens: int, alone: int | None, drafted: bool) -> None:
        """A forward committed `tokens`, `alone` of them the server's own candidates would
        have (None: unknown); `drafted`: it verified a client draft."""

    def sent(self, committed: int, told: Next | None, now: float) -> None:
        """The Verdict that made `committed` went out at monotonic `now`, telling `told`."""


class ServerPace(PaceRule):
    """Every Verdict asks for a draft; no forward waits for one."""

    def decide(self, busy: bool) -> Next | None:
        return Next.DRAFT


class Lockstep(ServerPace):
    """Every forward waits for the client's next message (a resume's catch-up may bring the
    client no token, so an answer is a message, not a length)."""

    def __init__(self) -> None:
        self._answered = 0  # the client's messages the forwards so far answered

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        await inbox.wait(lambda: inbox.answers > self._answered, None)
        self._answered = inbox.answers


class PaceMemory:
    """What auto pace learned of each of the last `size` clients, for its next session:
    learning afresh costs a generation its waits and the prompt's rows, as a probe does."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._learned: OrderedDict[str, AutoPace] = OrderedDict()

    def rule(self, client: str, pace: Pace, rtt_s: float | None, step_s: float) -> PaceRule:
        """`rtt_s`: the client's round trip as its Open said (None: unknown); `step_s`: the
        server's calibrated step, until measured."""
        if pace is not Pace.AUTO:
            return Lockstep() if pace is Pace.LOCKSTEP else ServerPace()
        learned = self._learned.get(client)
        if learned is None:
            return AutoPace(step_s, rtt_s)
        return replace(learned, _sent={}, _last_sent=None, _waited=0.0)

    def keep(self, client: str, rule: PaceRule) -> None:
        if isinstance(rule, AutoPace):
            self._learned[client] = rule
            self._learned.move_to_end(client)
            while len(self._learned) > self.size:
                self._learned.popitem(last=False)


@dataclass
class AutoPace(PaceRule):
    """Asks for a draft, and waits for it, while that pays.

    A round (Verdict sent to Verdict sent, its wait left out) on a client draft commits
    `gain_with` tokens in `with_s`, one on the server's own candidates `gain_alone` in `step_s`
    (measured in the forwards a draft was merged into: results log, `latency_paired`). A wait w
    pays while gain_with / (w + with_s) >= gain_alone / step_s; under load, where a wait costs
    the other sessions nothing, any draft that adds tokens is worth LOADED_WAIT_STEPS steps.
    While the client's replies (`reply_s`) come within that, the Verdict says draft and the
    next forward waits; otherwise rest, with a probe after PROBE_GAP forwards, doubling,
    unless even a draft of GAIN_CEILING tokens could not pay the reply time.
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
        with, then times the client's reply to the Verdict it answered."""
        sent_at, told, allowance = self._sent.get(committed, (0.0, None, 0.0))
        if told is Next.DRAFT and inbox.acked < committed:
            start = time.monotonic()
            await inbox.wait(lambda: inbox.acked >= committed, sent_at + allowance - start)
            self._waited = time.monotonic() - start
        answered = self._sent.get(inbox.acked)
        if answered is not None:
            self.reply_s = ema(self.reply_s, inbox.acked_at - answered[0], EMA_WEIGHT)
            self._sent = {n: s for n, s in self._sent.items() if n > inbox.acked}

    def forwarded(self, tokens: int, alone: int | None, drafted: bool) -> None:
        """The prior counts as PRIOR_FORWARDS forwards, so that one unlucky draft does not end
        the drafting (results log, `latency_paired`)."""
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
