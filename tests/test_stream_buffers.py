"""The two streams of a paced session (cloud_server/rpc/stream_buffers.py): the Inbox of the client's
drafts and acknowledgements, and the Outbox that writes Verdicts and their trailing rows under
flow control."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cloud_server.rpc import stream_buffers
from cloud_server.rpc.stream_buffers import Inbox, Outbox
from shared import wire
from shared.errors import OutOfOrder
from shared.messages import ActivationRows, DraftRequest, FinishReason, Next, Verdict
from shared.tree import DraftTree

TREE = DraftTree.chain([7])


async def settle() -> None:
    """Lets the Outbox's writer task write all it may (the writes here take no time): what it
    then holds back is what these tests check, and no event marks a writer that waits."""
    await asyncio.sleep(0.01)


def test_inbox_keeps_the_freshest_draft_and_the_longest_acknowledgement():
    inbox = Inbox(acked=4)
    inbox.put(DraftRequest(1, 5, TREE), committed=6)
    inbox.put(DraftRequest(3, 6, DraftTree((), ())), committed=6)  # an acknowledgement only
    assert inbox.draft.round_id == 1 and inbox.acked == 6
    inbox.used(1)
    assert inbox.draft is None


@pytest.mark.parametrize("draft, words", [
    (DraftRequest(1, 5, TREE), "ids must grow"),
    (DraftRequest(9, 7, TREE), "7 tokens, but 6 are committed"),
])
def test_inbox_refuses_drafts_out_of_order(draft, words):
    inbox = Inbox(acked=4)
    inbox.put(DraftRequest(1, 5, TREE), committed=6)
    with pytest.raises(OutOfOrder, match=words):
        inbox.put(draft, committed=6)


def test_inbox_refuses_a_draft_from_a_verdict_that_said_rest_but_takes_its_acknowledgement():
    inbox = Inbox(acked=4)
    inbox.told(6, Next.REST)
    inbox.told(7, Next.DRAFT)
    inbox.put(DraftRequest(1, 6, DraftTree((), ())), committed=7)  # acknowledges only
    with pytest.raises(OutOfOrder, match="where the server said rest"):
        inbox.put(DraftRequest(2, 6, TREE), committed=7)
    inbox.put(DraftRequest(3, 7, TREE), committed=7)
    assert inbox.draft.round_id == 3


def test_inbox_wait_wakes_on_a_draft_and_times_out_without_one():
    async def go():
        inbox = Inbox(acked=4)
        asyncio.get_running_loop().call_later(0.01, inbox.put, DraftRequest(1, 6, TREE), 6)
        woke = await inbox.wait(lambda: inbox.acked >= 6, 5.0)
        timed_out = await inbox.wait(lambda: inbox.acked >= 7, 0.01)
        return woke, timed_out
    assert asyncio.run(go()) == (True, False)


def test_a_verdict_is_handed_to_the_stream_before_the_next_forward(monkeypatch):
    """Outbox.send returns once the stream has taken the Verdict (its write completed), so the
    write's completion does not interrupt the next forward; a write the link does not take
    holds the session back HAND_OFF_S once, and a writer still busy with it not at all. The
    waits are read from the timeouts the outbox enters, not from a clock a busy machine skews."""
    monkeypatch.setattr(stream_buffers, "HAND_OFF_S", 0.3)  # far above the loop's jitter on a busy CI
    timeouts: list[asyncio.Timeout] = []
    real_timeout = asyncio.timeout

    def recorded(delay: float | None) -> asyncio.Timeout:
        timeouts.append(real_timeout(delay))
        return timeouts[-1]
    monkeypatch.setattr(stream_buffers.asyncio, "timeout", recorded)

    async def go():
        written: list[int] = []
        link_free = asyncio.Event()

        async def write(verdict: Verdict) -> None:
            for _ in range(3):  # gRPC completes a write on a later turn of the loop
                await asyncio.sleep(0)
            written.append(verdict.committed_length)
            if verdict.committed_length == 12:
                await link_free.wait()
        outbox = Outbox(write)
        await outbox.send(Verdict(1, (), (1,), 11))
        taken_before_return = list(written)
        await outbox.send(Verdict(2, (), (1,), 12))  # taken, but its write does not complete
        waits_after_held = len(timeouts)
        await outbox.send(Verdict(3, (), (1,), 13))  # the writer is busy: no wait
        waits_after_busy = len(timeouts)
        link_free.set()
        await outbox.flush()
        return taken_before_return, waits_after_held, waits_after_busy, written
    taken_before_return, waits_after_held, waits_after_busy, written = asyncio.run(go())
    assert taken_before_return == [11]
    assert waits_after_held == 2 and not timeouts[0].expired() and timeouts[1].expired()
    assert waits_after_busy == 2  # the busy writer was not waited for
    assert written == [11, 12, 13]


def _rows(start: int, n: int) -> ActivationRows:
    return ActivationRows(start, np.full((n, 4), start, dtype=np.float16))  # 8 bytes a row


def test_verdicts_go_before_rows_the_client_has_not_acknowledged():
    """Rows go out in parts while at most `rows_in_flight` bytes of them are unacknowledged; a
    Verdict goes before the rows still waiting, its own rows join them, and rows arrive in
    order. A Verdict that ends the generation takes no rows, and flush drops those waiting."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16, 10 * 8), 20 * 8)

        async def settled() -> list:
            await settle()
            got = list(written)
            written.clear()
            return [(type(m).__name__, m.start if isinstance(m, ActivationRows)
                     else m.committed_length) for m in got]
        await outbox.put(Verdict(0, (), (5,), 50, activations=_rows(0, 49)))
        steps = [await settled()]
        await outbox.put(Verdict(1, (), (6,), 51, activations=_rows(49, 1)))
        steps.append(await settled())
        outbox.held(20)
        steps.append(await settled())
        outbox.held(40)
        steps.append(await settled())
        await outbox.put(Verdict(2, (), (7,), 52, FinishReason.LENGTH, activations=_rows(50, 1)))
        await outbox.flush()
        steps.append(await settled())
        return steps
    steps = asyncio.run(go())
    assert steps[0] == [("Verdict", 50), ("ActivationRows", 0), ("ActivationRows", 10)]
    assert steps[1] == [("Verdict", 51)]  # before rows 20..49, which wait for the client
    assert steps[2] == [("ActivationRows", 20), ("ActivationRows", 30)]
    assert steps[3] == [("ActivationRows", 40), ("ActivationRows", 49)]  # 49: Verdict 51's
    assert steps[4] == [("Verdict", 52)]


def test_rows_past_the_budget_or_paused_wait_even_those_inside_verdicts():
    """A Verdict's few rows go inside it while the budget has room; past it the Verdicts go
    alone and their rows wait, in order, until the client acknowledges more. Paused (the
    server told the client to rest), no rows go at all until it asks for drafts again."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16 * 8, 10 * 8), 20 * 8)
        for start, n in ((0, 16), (16, 2), (18, 4), (22, 1)):
            await outbox.put(Verdict(start, (), (5,), start + n + 1,
                                     activations=_rows(start, n)))
            await settle()
        paused = [(m.committed_length, m.activations and m.activations.start)
                  for m in written]
        written.clear()
        outbox.held(18)
        outbox.pause(True)
        await outbox.put(Verdict(4, (), (5,), 25, activations=_rows(23, 1)))
        await settle()
        still_paused = [(m.committed_length, m.activations) for m in written]
        written.clear()
        outbox.pause(False)
        await settle()
        await outbox.flush()
        return paused, still_paused, [m.start for m in written]
    paused, still_paused, resumed = asyncio.run(go())
    assert paused == [(17, 0), (19, 16), (23, None), (24, None)]
    assert still_paused == [(25, None)]
    assert resumed == [18, 22, 23]


def test_without_acknowledgements_rows_follow_their_verdict_at_once():
    """Without a budget of rows in flight, rows follow their Verdict as soon as the link takes
    them."""
    async def go():
        written: list = []

        async def write(msg) -> None:
            written.append(msg)
        outbox = Outbox(write, lambda verdict: wire.trailing(verdict, 16, 10 * 8))
        await outbox.put(Verdict(0, (), (5,), 50, activations=_rows(0, 49)))
        await settle()
        await outbox.put(Verdict(1, (), (6,), 51, activations=_rows(49, 1)))
        await outbox.flush()
        return [m.start if isinstance(m, ActivationRows) else -m.committed_length
                for m in written]
    assert asyncio.run(go()) == [-50, 0, 10, 20, 30, 40, -51]
