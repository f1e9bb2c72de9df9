from __future__ import annotations

import numpy as np
import pytest

from shared.acceptance import accept_greedy
from shared.errors import InvalidRequest
from shared.tree import ROOT, DraftTree

#        root
#      /      \
#    0:a      1:b
#   /   \       \
# 2:c   3:d     4:e
#  |
# 5:f
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15), parents=(-1, -1, 0, 0, 1, 2))


def test_depths_and_ancestor_mask():
    assert TREE.depths().tolist() == [0, 0, 1, 1, 1, 2]
    mask = TREE.ancestor_mask()
    assert mask[5].nonzero()[0].tolist() == [0, 2, 5]
    assert mask[4].nonzero()[0].tolist() == [1, 4]
    assert np.array_equal(mask, mask & np.tri(6, dtype=bool))  # topological order


def test_path_tokens_and_chain():
    assert TREE.path_tokens(5) == [10, 12, 15]
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == (-1, 0, 1) and chain.path_tokens(2) == [7, 8, 9]


def argmax_after(choices: dict[int, int], default: int = 99) -> np.ndarray:
    """target_argmax: [1 + n] from {node (-1 = root): token}."""
    return np.array([choices.get(i, default) for i in range(-1, len(TREE))])


@pytest.mark.parametrize("choices, nodes, tokens", [
    ({-1: 10, 0: 12, 2: 15, 5: 7}, (0, 2, 5), (10, 12, 15, 7)),  # deepest path + bonus
    ({-1: 11, 1: 14, 4: 3}, (1, 4), (11, 14, 3)),  # second root branch
    ({-1: 10, 0: 13, 3: 4}, (0, 3), (10, 13, 4)),  # second sibling
    ({-1: 42}, (), (42,)),  # nothing accepted: the target's own token only
])
def test_greedy_acceptance_follows_target_argmax(choices, nodes, tokens):
    acceptance = accept_greedy(TREE, argmax_after(choices))
    assert acceptance.accepted_nodes == nodes
    assert acceptance.tokens == tokens


def test_validate_accepts_a_tree_at_its_limits_and_refuses_one_past_them():
    assert TREE.validate(vocab_size=100, max_nodes=6, max_depth=3) is None  # 6 nodes, 3 deep
    for limits in ({"vocab_size": 15}, {"max_nodes": 5}, {"max_depth": 2}):
        with pytest.raises(InvalidRequest):
            TREE.validate(**{"vocab_size": 100, "max_nodes": 6, "max_depth": 3, **limits})


@pytest.mark.parametrize("tree, words", [
    (DraftTree((), ()), "empty"),
    (DraftTree((1, 2), (-1, 1)), "earlier"),
    (DraftTree((1, 200), (-1, 0)), "outside"),
    (DraftTree((1, 1), (-1, -1)), "repeats"),
])
def test_validate_rejects_bad_trees(tree, words):
    with pytest.raises(InvalidRequest, match=words):
        tree.validate(vocab_size=100, max_nodes=6, max_depth=3)


def test_validate_limits():
    with pytest.raises(InvalidRequest, match="limit is 5"):
        TREE.validate(vocab_size=100, max_nodes=5, max_depth=3)
    with pytest.raises(InvalidRequest, match="deep"):
        TREE.validate(vocab_size=100, max_nodes=6, max_depth=2)


def test_merged_tree_is_the_union_of_paths_cut_to_size():
    moa = DraftTree((5, 6, 7), (ROOT, 0, 0))  # 5 -> {6, 7}
    lookup = DraftTree((5, 6, 8, 9), (ROOT, 0, 1, ROOT))  # 5 -> 6 -> 8, and 9
    merged = moa.merged(lookup, max_nodes=8)
    assert merged == DraftTree((5, 6, 7, 8, 9), (ROOT, 0, 0, 1, ROOT))
    assert merged.best_path()[:2] == moa.best_path()  # extended by the lookup's 8
    paths = {tuple(merged.path_tokens(i)) for i in range(len(merged))}
    assert paths == ({tuple(moa.path_tokens(i)) for i in range(len(moa))}
                     | {tuple(lookup.path_tokens(i)) for i in range(len(lookup))})
    cut = moa.merged(lookup, max_nodes=4)
    assert cut == DraftTree((5, 6, 7, 8), (ROOT, 0, 0, 1))
    cut.validate(vocab_size=10, max_nodes=4, max_depth=8)
    assert DraftTree((), ()).merged(lookup, 2) == DraftTree((5, 6), (ROOT, 0))
    # a node whose parent did not fit is dropped with its subtree
    assert moa.merged(DraftTree((9, 4), (ROOT, 0)), max_nodes=3) == moa


def test_verdict_parts_join_back_to_the_verdict():
    import numpy as np

    from shared import wire
    from shared.messages import ActivationFormat, ActivationRows, Verdict

    rows = ActivationRows(3, np.arange(40, dtype=np.float32).reshape(10, 4), ActivationFormat.FP16)
    verdict = Verdict(2, (0,), (7, 8), 15, activations=rows, draft_id=4)
    parts = wire.verdict_parts(verdict, max_bytes=3 * 8)  # 3 fp16 rows of width 4 a part
    assert [len(p.activations.values) for p in parts] == [3, 3, 3, 1]
    assert all(p.more and not p.tokens and p.committed_length == 13 for p in parts[:-1])
    assert [p.activations.start for p in parts] == [3, 6, 9, 12]
    joined = wire.join_parts(parts)
    assert joined == verdict and np.array_equal(joined.activations.values, rows.values)
    assert wire.verdict_parts(verdict, max_bytes=1 << 20) == [verdict]


def test_a_paced_verdicts_many_rows_trail_it_and_survive_the_wire():
    import numpy as np

    from shared import wire
    from shared.messages import ActivationFormat, ActivationRows, FinishReason, Next, Verdict
    from shared.pb.splitdec.v1 import splitdec_pb2 as pb

    rows = ActivationRows(3, np.arange(40, dtype=np.float32).reshape(10, 4), ActivationFormat.FP16)
    verdict = Verdict(2, (0,), (7, 8), 15, activations=rows, draft_id=4)
    assert wire.trailing(verdict, inline_bytes=10 * 8, max_bytes=1 << 20) == [verdict]
    head, *trail = wire.trailing(verdict, inline_bytes=10 * 8 - 1, max_bytes=4 * 8)
    assert head == Verdict(2, (0,), (7, 8), 15, draft_id=4) and head.activations is None
    assert [(r.start, len(r.values)) for r in trail] == [(3, 4), (7, 4), (11, 2)]
    for part in trail:
        back = wire.server_from_proto(wire.server_to_proto(part))
        assert back == part and np.array_equal(back.values, part.values)
    for told in (Next.DRAFT, Next.REST):
        paced = Verdict(2, (0,), (7, 8), 15, draft_id=4, next=told, draft_nodes=12)
        assert wire.server_from_proto(wire.server_to_proto(paced)) == paced
    generated = Verdict(2, (), (7,), 15)  # Generate's: nobody to tell
    raw = wire.server_to_proto(generated)
    assert raw.verdict.next == pb.NEXT_UNSPECIFIED
    assert wire.server_from_proto(raw).next is None
    last = Verdict(2, (0,), (7, 8), 15, FinishReason.LENGTH, activations=rows)
    assert wire.trailing(last, inline_bytes=0, max_bytes=1 << 20) == [
        Verdict(2, (0,), (7, 8), 15, FinishReason.LENGTH)]


def test_an_open_carries_the_protocol_version_and_the_round_trip():
    from shared import wire
    from shared.messages import PROTOCOL_VERSION, OpenRequest, Pace

    request = OpenRequest(prompt_ids=(5, 6), pace=Pace.AUTO, rtt_ms=42)
    raw = wire.client_to_proto(request)
    assert (raw.open.protocol_version, raw.open.rtt_ms) == (PROTOCOL_VERSION, 42)
    back = wire.client_from_proto(raw, 64)
    assert (back.protocol_version, back.rtt_ms, back.pace) == (PROTOCOL_VERSION, 42, Pace.AUTO)


def test_a_verdict_telling_the_edge_what_it_does_not_know_is_a_protocol_error():
    """A Verdict.next this client does not know (a newer server's): the edge never guesses
    what the server wants; wire.py refuses it and the link ends the generation with a
    LinkError naming the protocol."""
    import asyncio

    from edge_client.link import DecodeStream, LinkError
    from shared import wire
    from shared.pb.splitdec.v1 import splitdec_pb2 as pb

    raw = pb.ServerMessage(verdict=pb.Verdict(round_id=1, tokens=[7], committed_length=5))
    raw.verdict.next = 7  # proto3 keeps an enum number it does not know
    with pytest.raises(ValueError, match="unknown next value 7.*newer protocol"):
        wire.server_from_proto(raw)

    class OneReply:
        async def read(self):
            return raw

        def cancel(self) -> None:
            pass

    async def receive() -> None:
        await DecodeStream(OneReply(), "edge-test:1", round_timeout_s=5).recv()
    with pytest.raises(LinkError, match="protocol error from edge-test:1: unknown next value 7"):
        asyncio.run(receive())
