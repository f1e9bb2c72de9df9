"""When a session's next forward waits for the client's answer to the latest Verdict: its wait
policy (docs/architecture.md, "Pacing"), which the decode loop (decode_loop.py) asks before
every forward.

Lock-step waits always (`AlwaysWait`), so tokens/s is bounded by tau / (RTT + T_verify). Server
pace and server-side generation never wait (`NeverWait`): each forward verifies the freshest
client draft there is, if any. Pace AUTO waits for a draft in flight only while the wait is
expected to pay (`AutoPace`). Runs on the event loop; knows nothing of gRPC or of the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.drafting.base import DrafterName
from shared.messages import AUTO_LONGEST_WAIT, Pace
from shared.moving_average import ema

from cloud_server.rpc.stream_buffers import Inbox


@dataclass(frozen=True)
class PacingPolicy:
    """The server's side of pacing: what a session gets when its Open leaves pace or lead
    unset, the most lead it may ask for, and the drafter the server runs for its own
    candidates (None: a forward without client candidates is a plain decoding step), and
    whether `auto` waits longer for client drafts while other sessions have work queued."""

    pace: Pace = Pace.LOCKSTEP
    # Covers the client's acknowledgements queued behind a prompt's rows on a slow link
    # (results log, `pacing_notes`); a dead link costs at most this many tokens of forwards,
    # and they are kept for a resume.
    lead: int = 128
    max_lead: int = 256
    # Token Recycling: it drafts best of the server's own drafters (results log, `recycle_tau`)
    drafter: DrafterName | None = DrafterName.RECYCLE
    load_wait: bool = True

    def resolve(self, pace: Pace | None, lead: int, reads_rows: bool = True
                ) -> tuple[Pace, int]:
        """The session's pace and lead, from what its Open asked (None, 0: the defaults).
        `reads_rows`: the client drafts from the server's activation rows (MoA, Falcon).

        Auto waits only for such a client: a drafter that reads the text alone (prompt
        lookup, ADED) learns nothing from a Verdict but its tokens, so waiting for its draft
        saved no forwards and cost token rate (results log, `latency_rotated`). Its auto is
        server pace, and Opened says so."""
        pace = pace or self.pace
        if pace is Pace.AUTO and not reads_rows:
            pace = Pace.SERVER
        return pace, min(lead or self.lead, self.max_lead)


EMA_WEIGHT = 0.2  # AutoPace's running means: about the last five forwards (or replies) count
LOADED_WAIT_STEPS = 4  # AutoPace under load: the longest wait for a client's answer, in steps
# AutoPace alone: the share of its token rate a session gives up to make fewer forwards, since
# a forward is the node's capacity even when no other session waits for it (results log,
# `latency_thrift`)
FORWARD_THRIFT = 0.1
# AutoPace: forwards after the client's answer it measures before it trusts gain_client. Until
# then it waits (within half a step) for an answer due in time, to learn what drafts are worth
LEARNING_FORWARDS = 3
# AutoPace: forwards without the client's answer, at least, before it measures the client's
# drafts again where its own candidates fell off; doubles each time, so a text on which they
# never pay costs a few learning waits, not one in every few forwards
RELEARN_AFTER = 8
# ... and where they commit at most this share of what they did in the learning forwards:
# clear of the running mean's own noise (results log, `latency_relearn`)
FELL_OFF = 0.75


class WaitPolicy:
    """How long the forward about to run waits for the client's answer (`wait`), what the
    Verdict then tells the client (`answer_awaited`), and what the policy learns from each
    forward and send. The base waits for nothing."""

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        """Before a forward at `committed` tokens; `busy`: other sessions have work queued."""

    def answer_awaited(self, inbox: Inbox, busy: bool) -> bool:
        """Whether the client's answer to the Verdict sent now is waited for
        (Verdict.answer_awaited): where it is not, the client leaves mere acknowledgements
        unsent."""
        return False

    def forwarded(self, tokens: int, fresh: bool, step_s: float, alone: int | None = None
                  ) -> None:
        """A forward committed `tokens` in `step_s` (see AutoPace.forwarded)."""

    def sent(self, committed: int, now: float) -> None:
        """The Verdict that made `committed` went to the client at monotonic `now`."""


class NeverWait(WaitPolicy):
    """Server pace and server-side generation: no forward waits for the client."""


class AlwaysWait(WaitPolicy):
    """Lock-step: every forward waits for the client's answer to the latest Verdict (a resume's
    catch-up may bring the client no token, so an answer is a new message, not a length)."""

    def __init__(self) -> None:
        self._answered = 0  # the client's messages the forwards so far answered

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        await inbox.wait(lambda: inbox.answers > self._answered, None)
        self._answered = inbox.answers

    def answer_awaited(self, inbox: Inbox, busy: bool) -> bool:
        return True


def wait_policy(pace: Pace) -> WaitPolicy:
    """The wait policy of a Decode session at `pace`."""
    if pace is Pace.LOCKSTEP:
        return AlwaysWait()
    return AutoPace() if pace is Pace.AUTO else NeverWait()


@dataclass
class AutoPace(WaitPolicy):
    """When to wait for the client's answer to the latest Verdict before the next forward.

    A forward after the answer commits `gain_client` tokens in `client_step_s`; one before it
    `gain_alone` (what the server's own tree follows of those same forwards' tokens) in
    `step_s`. Waiting w pays when gain_client / (w + client_step_s) > t * gain_alone / step_s,
    with t = 1 - min(FORWARD_THRIFT, 1 - gain_alone / gain_client): a wait may cost the session
    a little token rate to save the node a forward, never more than the share it saves
    (results log, `latency_thrift`). gain_alone comes from the same forwards, since those a
    draft comes for are not a fair sample (`latency_paired`); `gain_server` stands in until
    it is measured. The wait is capped at half a step, and only an answer that comes in time
    reliably is waited for (`wait_s`; `latency_autopace`). So auto behaves like lock-step
    where the client answers in time and its drafts pay, and like server pace where not.

    Under load a forward is the scarce resource and waiting costs the other sessions nothing,
    so a busy server waits for an answer due within LOADED_WAIT_STEPS steps. A resting client
    (Draft.rows_paused) answers only now and then and is never waited for.

    Until LEARNING_FORWARDS forwards after an answer are measured, gain_client is a prior, and
    auto waits up to half a step for an answer due in time, to measure it (`latency_thrift`),
    but only once the client has sent a draft with nodes (`drafted`; `latency_awaited`). Where
    auto stopped waiting and the server's own candidates then commit clearly less than in the
    forwards it learned from, it learns again (`_measured_elsewhere`), at most once per
    RELEARN_AFTER forwards, doubling (`latency_relearn`).
    """

    step_s: float | None = None  # a forward before the client's answer
    client_step_s: float | None = None  # a forward after it
    reply_s: float | None = None  # Verdict sent -> the client's answer to it arrives
    reply_spread_s: float = 0.0  # mean distance of a reply time from reply_s
    gain_client: float = 2.0
    gain_server: float = 1.2
    # In the forwards after the client's answer: what the server's own candidates alone would
    # have committed (None: not measured)
    gain_alone: float | None = None
    fresh_forwards: int = 0  # measured forwards after the client's answer (since learning)
    drafted: bool = False  # the client has sent a draft with nodes (Inbox.drafted)
    since_fresh: int = 0  # forwards since the last one after the client's answer
    relearn_after: int = RELEARN_AFTER
    _sent_at: dict[int, float] = field(default_factory=dict)

    async def wait(self, inbox: Inbox, committed: int, busy: bool) -> None:
        """Waits for the answer while it is due in time and worth the wait (`wait_s`); a
        resting client is never waited for."""
        self.drafted = inbox.drafted
        if inbox.acked < committed and not inbox.resting:
            await inbox.wait(lambda: inbox.acked >= committed,
                             self.wait_s(committed, time.monotonic(), busy))
        self.answered(inbox.acked, inbox.acked_at)

    def answer_awaited(self, inbox: Inbox, busy: bool) -> bool:
        return not inbox.resting and self.awaits(busy)

    def allowance_s(self) -> float:
        if self.fresh_forwards < LEARNING_FORWARDS:
            return (self.step_s or 0.03) * AUTO_LONGEST_WAIT if self.drafted else 0.0
        return self._worth_s(self.without_draft())

    def _worth_s(self, alone: float) -> float:
        """The longest wait for a fresh draft that pays against forwards committing `alone`
        tokens without it."""
        step = self.step_s or 0.03
        # The share of its token rate the session gives up is at most the share of forwards
        # the wait saves: for drafts that add next to nothing, none (results log,
        # `latency_paired`)
        saved = 1 - alone / self.gain_client
        if saved <= 0:
            return 0.0
        server_rate = (1 - min(FORWARD_THRIFT, saved)) * alone / step
        worth = self.gain_client / server_rate - (self.client_step_s or step)
        return min(step * AUTO_LONGEST_WAIT, max(0.0, worth))

    def without_draft(self) -> float:
        """What a forward the server does not wait for commits: gain_alone once measured."""
        return self.gain_server if self.gain_alone is None else self.gain_alone

    def awaits(self, busy: bool = False) -> bool:
        """Whether the client's answer to the Verdict sent now is waited for, as the client is
        told with it (Verdict.answer_awaited): where it is not, the client leaves its mere
        acknowledgements unsent, and the server's core reads fewer messages. An answer is
        waited for only when it comes within the allowance reliably (`wait_s`); until the
        reply time is measured, it is awaited, so that it gets measured."""
        allowance = self._allowance(busy)
        return allowance > 0 and (self.reply_s is None or self._in_time(allowance))

    def _in_time(self, allowance: float) -> bool:
        """The client's answers come within `allowance` reliably (reply time measured)."""
        return (self.reply_s is not None
                and self.reply_s + 2 * self.reply_spread_s <= allowance)

    def _allowance(self, busy: bool) -> float:
        if busy and self.gain_client > self.without_draft():
            return (self.step_s or 0.03) * LOADED_WAIT_STEPS
        return self.allowance_s()

    def wait_s(self, committed: int, now: float, busy: bool = False) -> float:
        """How long to wait now for the answer to the Verdict that made `committed`; `busy`:
        other sessions have work on the model."""
        allowance = self._allowance(busy)
        sent = self._sent_at.get(committed)
        if sent is None or self.reply_s is None:  # no evidence the answer comes in time
            return 0.0
        # An answer that comes within the allowance only on average is waited for in vain
        # half the time: wait for one that comes reliably (results log, `latency_autopace`).
        late = sent + self.reply_s + 2 * self.reply_spread_s - now
        return max(0.0, late) if late <= allowance else 0.0

    def sent(self, committed: int, now: float) -> None:
        self._sent_at[committed] = now

    def answered(self, acked: int, at: float) -> None:
        """The client has acknowledged length `acked` (received at `at`): measures its reply
        time to that Verdict and forgets the older ones (called every forward; a resting edge
        answers seldom, so nothing is rebuilt until it does)."""
        sent = self._sent_at.get(acked)
        if sent is None:
            return
        if self.reply_s is not None:
            spread = abs(at - sent - self.reply_s)
            self.reply_spread_s = ema(self.reply_spread_s, spread, EMA_WEIGHT)
        self.reply_s = ema(self.reply_s, at - sent, EMA_WEIGHT)
        self._sent_at = {n: t for n, t in self._sent_at.items() if n > acked}

    def forwarded(self, tokens: int, fresh: bool, step_s: float, alone: int | None = None
                  ) -> None:
        """A forward committed `tokens` in `step_s`, `alone` of them the server's own
        candidates would have (None: unknown); `fresh`: it ran after the client's answer to
        the latest Verdict. An answer without a draft counts as a draft that added nothing,
        so auto finishes learning from an edge with no match to draft (results log,
        `latency_paired`)."""
        if fresh:
            # The first measurement replaces the prior, and the learning forwards count
            # evenly until the running mean's weight takes over, so a few drafts that added
            # nothing read as such (results log, `latency_paired`, `latency_awaited`).
            prior = None if self.fresh_forwards == 0 else self.gain_client
            self.fresh_forwards += 1
            weight = max(EMA_WEIGHT, 1 / self.fresh_forwards)
            self.gain_client = ema(prior, tokens, weight)
            self.client_step_s = ema(self.client_step_s, step_s, weight)
            if alone is not None:  # a forward commits its own token at least
                self.gain_alone = ema(self.gain_alone, max(1, alone), weight)
            self.since_fresh = 0
        else:
            self.gain_server = max(1.0, ema(self.gain_server, tokens, EMA_WEIGHT))
            self.step_s = ema(self.step_s, step_s, EMA_WEIGHT)
            self.since_fresh += 1
            if self._measured_elsewhere():
                self.fresh_forwards, self.relearn_after = 0, 2 * self.relearn_after

    def _measured_elsewhere(self) -> bool:
        """Whether what keeps auto from waiting was measured on text unlike the present: it
        set the client's drafts against the `gain_alone` the server's own candidates
        committed in the learning forwards, but those now commit `gain_server`, few enough
        that a wait for an answer due in time would pay. Then the next forwards learn again
        (results log, `latency_relearn`)."""
        return (self.fresh_forwards >= LEARNING_FORWARDS
                and self.since_fresh >= self.relearn_after
                and self.gain_server <= FELL_OFF * self.without_draft()
                and self._in_time(self._worth_s(self.gain_server)))
