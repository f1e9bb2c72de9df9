"""The edge's side of a server-paced session: which of its drafts the server may still use,
whether the next is worth drafting, and what became of each.

The server re-roots the edge's freshest draft at its own committed position before every
forward (shared/rerooting.py). So while the last draft sent still continues the committed text,
a new one would only repeat it, and the edge just acknowledges the Verdict; once a forward used
the draft, or the text left it, the edge drafts again from the newest position.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from shared.messages import DraftRequest, Verdict
from shared.rerooting import reroot
from shared.tree import DraftTree

PATIENCE = 3  # drafts overtaken unused, since the last that earned, before the edge rests
FIRST_REST = 8  # chances the first rest skips; it doubles with every probe overtaken too
MAX_REST = 64  # so the edge notices within about 64 Verdicts when its drafts pay again
# A resting edge acknowledges once per this share of the server's lead: often enough that the
# lead never stops the server, seldom enough that answers do not cost the server's core
ACKS_PER_LEAD = 4
# Generations in a row that open resting, carried from the one before (DraftSpacing.carried),
# after the first rest learned on a link; each generation that learns the link afresh and rests
# again doubles it, up to MAX_CARRY
CARRY_GENERATIONS = 4
MAX_CARRY = 16
# A carried rest ends at once when the link's round trip falls below this share of the one the
# rest was learned under (a researcher switching `--network` profiles, a laptop off satellite)
FASTER_LINK = 0.7


class DraftSpacing:
    """Whether the edge drafts at a chance (a Verdict when a draft is due), and whether it wants
    the server's activation rows meanwhile.

    Where the link is slow the server commits past every draft before a forward can use it;
    each draft then only costs the edge CPU, and its rows cost the downlink ahead of the
    Verdicts (results log, `latency_rested`). So after PATIENCE drafts that the server
    overtook unused on a link too slow for it to wait (their first nodes were right: a draft
    wrong from its first node says nothing of the link) the edge rests: it lets FIRST_REST
    chances pass, doubling with every probe overtaken too up to MAX_REST, then probes with a
    draft from what it holds. Only a draft that gets a node accepted ends the rest. Meanwhile
    the edge wants no rows (Draft.rows_paused; they wait on the server) and answers only now
    and then (DraftFollower.needless), probes included (`latency_verdict_first`).

    An edge whose drafter reads the text alone (`reads_rows` False: prompt lookup, ADED) also
    rests after PATIENCE drafts in a row that added nothing: wrong, or redundant with the
    server's own candidates, which read the same text (Verdict.draft_redundant;
    `latency_carry_backoff`). A drafter fed the server's rows keeps drafting: what it adds
    comes from the rows, and resting would pause them.
    """

    def __init__(self, reads_rows: bool = True, rests: bool = True) -> None:
        """`rests` False: never rests (lock-step, where the server waits for every draft)."""
        self.reads_rows, self.rests = reads_rows, rests
        self._unpaid = 0  # drafts that did not pay since the last that earned
        self._rest = 0  # chances still to let pass
        self._resting = False
        self._carried = 0  # generations in a row that opened resting
        self._carry_limit = CARRY_GENERATIONS  # how many may, before one learns afresh
        self._rest_rtt = 0.0  # the link's round trip when the carried rest was learned
        self._paid = False  # a draft earned in this generation

    def carried(self, outpaced: bool, rtt_s: float) -> "DraftSpacing":
        """The spacing the next generation on the same link starts with: resting, its rows
        paused from the Open (Open.rows_paused), where this one rests with no draft earned and
        the link is `outpaced` (its round trip is longer than the server's forward:
        GenerationResult.link_outpaced), since learning the link again costs the server CPU
        and the link the prompt's rows (results log, `latency_carried_rest`). Every
        CARRY_GENERATIONS carried generations the next learns afresh, so a server or text that
        lets drafts pay is noticed; each that rests again unpaid doubles the run up to
        MAX_CARRY, and a round trip (`rtt_s`, measured at the Open) below FASTER_LINK of the
        one the rest was learned under ends it at once (`latency_carry_backoff`)."""
        spacing = DraftSpacing(self.reads_rows)
        if not outpaced or not self._resting or self._paid:
            return spacing
        learned = self._carried == 0  # this generation learned the link
        if not learned and rtt_s < FASTER_LINK * self._rest_rtt:
            return spacing
        if self._carried >= self._carry_limit:  # learn afresh; rested again, carry longer
            spacing._carry_limit = min(MAX_CARRY, 2 * self._carry_limit)
            return spacing
        spacing._unpaid, spacing._resting = self._unpaid, True
        spacing._carried, spacing._carry_limit = self._carried + 1, self._carry_limit
        spacing._rest_rtt = rtt_s if learned else self._rest_rtt
        spacing._rest_again()
        return spacing

    def earned(self) -> None:
        """A forward accepted one of the draft's nodes."""
        self._unpaid = self._rest = 0
        self._resting, self._paid = False, True

    def overtaken(self, link_slow: bool) -> None:
        """The server's text followed the draft, but no forward used it before the server got
        past its right nodes. Where the link is not `link_slow` (its round trip is within the
        longest wait auto pace gives an answer, GenerationResult.link_slow), the server chose
        not to wait for the draft (server pace, or auto while it judged a wait not worth it):
        that says nothing of the link, so a drafter fed the server's rows does not rest from
        it and its drafts stay there for auto pace to measure again (results log,
        `latency_relearn`). A drafter that reads the text alone rests from it still: the
        server's own lookup had those tokens."""
        if link_slow or not self.reads_rows:
            self._not_paid()

    def redundant(self) -> None:
        """A forward accepted some of the draft's nodes, but the server's own candidates had
        every one of those tokens (Verdict.draft_redundant)."""
        if self.reads_rows:
            self.earned()
        else:
            self._not_paid()

    def _not_paid(self) -> None:
        self._unpaid += 1
        if self._unpaid >= PATIENCE and self.rests:
            self._resting = True
            self._rest_again()

    def missed(self) -> None:
        """The draft was wrong from its first node, or a forward used it and accepted none of
        it: nothing learned of the link, but a probe that earned nothing rests again. For an
        edge that drafts from the text alone it is a draft that did not pay, as a redundant
        one: the server's own lookup reads the same text."""
        if not self.reads_rows:
            self._not_paid()
        elif self._resting:
            self._rest_again()

    def _rest_again(self) -> None:
        self._rest = min(MAX_REST, FIRST_REST * 2 ** max(0, self._unpaid - PATIENCE))

    @property
    def resting(self) -> bool:
        """While resting the edge drafts only at probes and wants no rows."""
        return self._resting

    def chance(self) -> bool:
        """Called at each chance to draft: True when the edge should draft at this one."""
        if self._rest > 0:
            self._rest -= 1
            return False
        return True


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


class DraftFollower:
    """Draft ids and the live draft of one Decode stream (ids start again on a new stream),
    whether the drafts it sent earned anything (`spacing`), and what became of each
    (`outcomes`, kept across the generation's streams)."""

    def __init__(self, spacing: DraftSpacing | None = None,
                 outcomes: DraftOutcomes | None = None) -> None:
        self.spacing = spacing or DraftSpacing()
        self.outcomes = outcomes or DraftOutcomes()
        self._next_id = 1
        self._live: DraftRequest | None = None
        self._last_sent: DraftRequest | None = None

    def sent(self, draft: DraftRequest) -> DraftRequest:
        """`draft` numbered for sending; a draft with nodes becomes the live one."""
        draft = replace(draft, round_id=self._next_id)
        self._next_id += 1
        if len(draft.tree):
            self._live = draft
        self._last_sent = draft
        return draft

    def needless(self, draft: DraftRequest, lead: int, awaited: bool) -> bool:
        """True when `draft`, a mere acknowledgement that tells nothing new of the rows or the
        rest, need not go: nobody waits for it (the server said so, `awaited`:
        Verdict.answer_awaited, or it knows the edge rests: Draft.rows_paused) and the server
        is far from its `lead`. Each answer costs the server's event loop a read on the core
        its forwards run on (results log, `latency_verdict_first`, `latency_awaited`)."""
        last = self._last_sent
        if (len(draft.tree) or last is None or lead <= 0
                or draft.base_length - last.base_length >= lead // ACKS_PER_LEAD):
            return False
        news = draft.rows_held != last.rows_held or draft.rows_paused != last.rows_paused
        return not news and (not awaited or draft.rows_paused)

    def due(self, context: Sequence[int], link_slow: bool) -> bool:
        """True when a new draft is due: the live one no longer has nodes past `context`.
        `link_slow`: no wait of the server's can cover the link's round trip
        (DraftSpacing.overtaken)."""
        live = self._live
        if live is None:
            return True
        if reroot(live.tree, live.base_length, context) is not None:
            return False
        path = live.tree.walk(context[live.base_length:])
        if path:  # right as far as `path`, but no forward used it before the server got past
            self.outcomes.late += 1
            self.spacing.overtaken(link_slow)
        else:
            self.outcomes.wrong += 1
            self.spacing.missed()
        self._live = None
        return True

    def verified(self, verdict: Verdict, context: Sequence[int]) -> DraftTree | None:
        """The live draft as the server verified it in `verdict` (re-rooted at `context`, the
        committed text before it), or None when the forward used none of the edge's nodes. A
        used draft is spent: what it did not get accepted can never continue the text."""
        live = self._live
        if live is None or verdict.draft_id != live.round_id:
            return None
        self._live = None
        self.outcomes.used += 1
        self.outcomes.earned += bool(verdict.accepted_nodes)
        if verdict.accepted_nodes and verdict.draft_redundant:
            self.spacing.redundant()
        elif verdict.accepted_nodes:
            self.spacing.earned()
        else:
            self.spacing.missed()
        rerooted = reroot(live.tree, live.base_length, context)
        return None if rerooted is None else rerooted.proposal.tree

