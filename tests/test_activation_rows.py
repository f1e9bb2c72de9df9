"""Activation rows are computed when a Verdict takes them (cloud_server/decoding/activation_rows.py):
none while the server tells the edge to rest (Verdict.next), all that the rest held back in the
first Verdict that asks for a draft again, and the same rows as computing them after every
forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_server.decoding.activation_rows import RowKeeper
from cloud_server.moa.activations import ServerActivations
from cloud_server.decoding.server_decoding import PLAIN
from cloud_server.decoding.session import Session
from shared.draft_q import Proposal
from shared.messages import ActivationFormat, Limits, OpenRequest, Pace

WIDTH = 3


class CountingSource:
    """Row i of a position is (position, hidden sum or -1); records every call."""

    def __init__(self, layers: tuple[int, ...] = ()):
        self.hidden_layers = layers
        self.calls: list[tuple[int, int]] = []

    def __call__(self, cache, start, end, hidden=None):
        self.calls.append((start, end))
        if self.hidden_layers:
            assert hidden is not None and hidden.shape[0] == end - start
        sums = (hidden.sum(dim=(1, 2)).numpy() if hidden is not None
                else -np.ones(end - start))
        return np.stack([np.arange(start, end), sums, np.zeros(end - start)], 1).astype(
            np.float16)


def test_rows_go_out_as_each_forward_verifies_them():
    source = CountingSource()
    keeper = RowKeeper(source, ActivationFormat.FP16)
    keeper.verified(0, 5, None)
    first = keeper.taken(None, 0)
    keeper.verified(5, 7, None)
    second = keeper.taken(None, 5)
    assert (first.start, len(first.values), second.start, len(second.values)) == (0, 5, 5, 2)
    assert source.calls == [(0, 5), (5, 7)]
    assert second.values[:, 0].tolist() == [5, 6]


def test_a_pause_computes_nothing_and_the_first_verdict_after_carries_what_it_held_back():
    source = CountingSource()
    keeper = RowKeeper(source, ActivationFormat.FP16)
    keeper.verified(0, 4, None)
    keeper.taken(None, 0)
    keeper.paused = True
    for start, end in [(4, 6), (6, 7), (7, 9)]:
        keeper.verified(start, end, None)
        assert keeper.taken(None, start) is None
    assert source.calls == [(0, 4)]
    keeper.paused = False
    keeper.verified(9, 10, None)
    rows = keeper.taken(None, 9)
    assert rows.start == 4 and rows.values[:, 0].tolist() == list(range(4, 10))
    assert source.calls == [(0, 4), (4, 10)]  # the held-back rows in one call


def test_held_back_rows_of_a_source_that_reads_layer_outputs_keep_their_outputs():
    source = CountingSource(layers=(1,))
    keeper = RowKeeper(source, ActivationFormat.FP16)
    keeper.paused = True
    outputs = [torch.full((n, 1, WIDTH), float(i)) for i, n in enumerate([3, 1, 2])]
    start = 0
    for hidden in outputs:
        keeper.verified(start, start + len(hidden), hidden)
        start += len(hidden)
    keeper.paused = False
    rows = keeper.taken(None, 5)
    assert rows.start == 0 and rows.values[:, 1].tolist() == [0, 0, 0, 3, 6, 6]


def test_a_resume_gets_rows_from_where_the_edge_says_it_holds_them():
    keeper = RowKeeper(CountingSource(), ActivationFormat.FP16)
    keeper.verified(0, 6, None)
    keeper.taken(None, 0)
    again = keeper.taken(None, 2)  # the rows after 2 were lost with the stream
    assert again.start == 2 and len(again.values) == 4


def test_rows_must_follow_the_verified_positions_without_a_gap():
    keeper = RowKeeper(CountingSource(), ActivationFormat.FP16)
    keeper.verified(0, 4, None)
    with pytest.raises(ValueError, match="from 4"):
        keeper.verified(5, 6, None)


@pytest.mark.parametrize("pace", [Pace.AUTO, Pace.LOCKSTEP])
def test_a_paced_session_told_to_rest_from_the_start_sends_the_same_rows_once_asked(
        tiny_target, tiny_drafter_dir, pace):
    """Auto pace tells a client on a slow link to rest from the first Verdict (the decode loop
    pauses the rows before the prefill): none is computed until a Verdict asks for a draft,
    and that one carries every row. In lock-step the edge drafts from every Verdict's rows:
    they are never held back."""
    source = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    request = OpenRequest(prompt_ids=(1, 46, 47, 48, 49), max_new_tokens=8,
                          activations=ActivationFormat.FP16, pace=pace)
    limits = Limits(max_tree_nodes=16, max_tree_depth=8)
    awake = Session.open(tiny_target, limits, request, source)
    resting = Session.open(tiny_target, limits, request, source)
    resting.pause_rows(True)
    sent = [awake.prefill()] + [awake.advance(Proposal(PLAIN)) for _ in range(4)]
    if pace is Pace.LOCKSTEP:
        assert resting.prefill().activations.values.shape == sent[0].activations.values.shape
        return
    held = [resting.prefill()] + [resting.advance(Proposal(PLAIN)) for _ in range(3)]
    assert all(v.activations is None for v in held)
    resting.pause_rows(False)
    caught_up = resting.advance(Proposal(PLAIN)).activations
    expected = np.concatenate([v.activations.values for v in sent])
    # Computed in one call over all nine positions, not over five then one at a time: the
    # matmuls block differently, and a CPU can round the last fp16 bit of a few values apart.
    assert caught_up.start == 0 and caught_up.values.shape == expected.shape
    np.testing.assert_allclose(caught_up.values, expected, rtol=2 ** -9, atol=1e-6)
