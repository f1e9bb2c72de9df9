"""The MoA drafter on the edge (onnxruntime), fed by the server half in-process on the tiny
target: its greedy drafts equal the torch edge half's, and split decoding with it stays
identical to plain greedy decoding while accepting drafts."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.in_process import split_greedy
from cloud_server.moa.activations import ServerActivations
from cloud_server.moa.weights import load_drafter
from cloud_server.reference import plain_greedy
from edge_client.drafters.lookup_merge import LookupMerge
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.trained import trained_drafter
from edge_client.drafters.tree_search import TreeSearch
from shared.drafter_bundle import Precision
from shared.drafting.base import DrafterName, reads_activations
from shared.tree import DraftTree

PROMPT = [1, 46, 47, 48, 49]


@torch.no_grad()
def torch_greedy_chain(edge, context: list[int], activations: np.ndarray, depth: int) -> list[int]:
    """Reference: the torch edge half recomputed from scratch for every drafted token."""
    acts = torch.from_numpy(activations.astype(np.float32))[None]  # [1, v, width]
    mem = edge.memory_kv(acts, torch.arange(acts.shape[1]))
    ids = list(context)
    for _ in range(depth):
        positions = torch.arange(len(ids))
        keys, values = edge.sa_kv(torch.tensor([ids]), positions)
        causal = torch.zeros(1, 1, len(ids), len(ids)).masked_fill(
            torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1), torch.finfo().min)
        hidden = edge.hidden(torch.tensor([ids]), positions, keys, values, causal, *mem, None)
        ids.append(int(edge.vocab_ids[edge.logits(hidden[0, -1]).argmax()]))
    return ids[len(context):]


def test_greedy_drafts_match_torch(tiny_target, tiny_drafter_dir, tiny_bundle):
    _, _, edge = load_drafter(tiny_drafter_dir, tiny_target.model)
    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    cache, _ = tiny_target.prefill(PROMPT)
    acts = server(cache, 0, len(PROMPT), dtype=np.float32)  # [len(PROMPT), width]
    drafter = MoaDrafter(MoaGraphs(tiny_bundle, Precision.FP32),
                         TreeSearch(max_depth=6, beam=1, branch=1))
    drafter.reset(PROMPT)
    drafter.add_activations(0, acts)
    context = PROMPT + [30]  # the first answer token: pending, no activation yet
    tree = drafter.propose(context, max_nodes=6)
    assert tree == DraftTree.chain(tree.tokens) and len(tree) == 6
    assert list(tree.tokens) == torch_greedy_chain(edge, context, acts, 6)
    again = drafter.propose(context, max_nodes=6)  # the same state drafts the same tree
    assert again == tree


@pytest.mark.parametrize("precision", list(Precision))
def test_split_decoding_with_moa_equals_plain_greedy(tiny_target, tiny_drafter_dir, tiny_bundle,
                                                     precision):
    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    drafter = trained_drafter(tiny_bundle, DrafterName.MOA,
                              TreeSearch(max_depth=6, beam=4, branch=4), precision=precision)
    tokens, per_round = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=16)
    assert tokens == plain_greedy(tiny_target, PROMPT, len(tokens))
    assert sum(per_round) / len(per_round) > 1.5, per_round  # drafts get accepted


def test_merging_drafter_drafts_graphs_and_equals_plain_greedy(tiny_target, tiny_drafter_dir,
                                                               tiny_bundle):
    """GSD merging: a token repeated at one depth is expanded once and its subtree repeated
    under each parent, breadth first, so the wire sends it once; the text stays plain greedy's."""
    from shared.draft_graph import breadth_first, fold

    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    drafter = trained_drafter(tiny_bundle, DrafterName.MOA,
                              TreeSearch(max_depth=6, beam=4, branch=4, merge=True),
                              precision=Precision.FP32)
    trees = []
    propose = drafter.propose

    def recorded(context, max_nodes):
        trees.append(propose(context, max_nodes))
        return trees[-1]

    drafter.propose = recorded
    tokens, _ = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=48)
    assert tokens == plain_greedy(tiny_target, PROMPT, len(tokens))
    assert all(tree == breadth_first(tree) and len(tree) <= 48 for tree in trees)
    assert sum(len(tree) - len(fold(tree).tree) for tree in trees) > 0


def test_activations_are_fp16_rows_of_width(tiny_target, tiny_drafter_dir):
    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    cache, _ = tiny_target.prefill(PROMPT)
    acts = server(cache, 1, 4)
    assert acts.dtype == np.float16 and acts.shape == (3, server.config.width)


def test_drafter_needs_activations_and_rejects_gaps(tiny_bundle):
    drafter = MoaDrafter(MoaGraphs(tiny_bundle, Precision.FP32))
    assert reads_activations(drafter)
    drafter.reset(PROMPT)
    assert len(drafter.propose(PROMPT, 8)) == 0  # nothing verified yet: nothing to offer
    with pytest.raises(ValueError):
        drafter.add_activations(2, np.zeros((1, drafter.graphs.width), np.float16))


def test_int8_activations_round_trip_closely(tiny_target, tiny_drafter_dir):
    from shared.activation_codec import from_int8, to_int8

    server = ServerActivations.load(tiny_drafter_dir, tiny_target.model)
    cache, _ = tiny_target.prefill(PROMPT)
    acts = server(cache, 0, len(PROMPT), dtype=np.float32)  # [n, width]
    values, scales = to_int8(acts)
    assert values.dtype == np.int8 and scales.dtype == np.float16
    error = np.abs(from_int8(values, scales) - acts).max(axis=1)  # [n]
    assert (error <= 0.6 * np.abs(acts).max(axis=1) / 127 + 1e-6).all()


def test_edge_side_of_moa_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nimport edge_client.drafters.moa, edge_client.drafters.moa_bundle\n"
            "import shared.activation_codec\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_independent_baseline_feeds_its_own_memory(tiny_target, tiny_independent_bundle):
    """The baseline's memory is the verified tokens' embeddings: no activations, and split
    decoding with it stays lossless."""
    graphs = MoaGraphs(tiny_independent_bundle, Precision.FP32)
    drafter = LookupMerge(MoaDrafter(graphs, TreeSearch(max_depth=6, beam=4, branch=4)))
    assert not reads_activations(drafter)
    with pytest.raises(ValueError, match="no activations"):
        drafter.add_activations(0, np.zeros((1, graphs.width), dtype=np.float32))
    tokens, per_round = split_greedy(tiny_target, None, drafter, PROMPT, 32, max_nodes=16)
    assert tokens == plain_greedy(tiny_target, PROMPT, len(tokens))
    assert sum(per_round) / len(per_round) > 1.2, per_round
    context = PROMPT + tokens[:5]
    assert drafter.propose(context, 8) == drafter.propose(context, 8)  # rewinds its memory
    drafter.reset(PROMPT)
    assert drafter.propose(context, 8) == drafter.propose(context, 8)


def test_lookup_nodes_merge_a_repeated_phrase(tiny_bundle):
    """With lookup_nodes, a text that repeats itself gets the copy's continuation as well."""
    phrase = [60, 61, 62, 63, 64, 65]
    context = PROMPT + phrase + [70, 71] + phrase[:2]
    search = TreeSearch(max_depth=4, beam=2, branch=2)
    without = MoaDrafter(MoaGraphs(tiny_bundle, Precision.FP32), search)
    with_lookup = LookupMerge(MoaDrafter(MoaGraphs(tiny_bundle, Precision.FP32), search), 4)
    for drafter in (with_lookup, without):
        drafter.reset(context[:-1])
        drafter.add_activations(0, np.zeros((len(context) - 1, without.graphs.width),
                                            np.float32))
    tree = with_lookup.propose(context, max_nodes=16)
    paths = {tuple(tree.path_tokens(i)) for i in range(len(tree))}
    assert tuple(phrase[2:6]) in paths and len(tree) == 16
    plain = without.propose(context, 16)
    assert tuple(phrase[2:6]) not in {tuple(plain.path_tokens(i)) for i in range(len(plain))}
    # the lookup gets a quarter of the budget at most: none below 4 nodes
    assert with_lookup.propose(context, 3) == without.propose(context, 3)


@pytest.mark.parametrize("name", ["last", "fused"])
def test_hidden_input_drafter_through_the_session(tiny_target, tiny_drafter_dir, name,
                                                  tmp_path_factory):
    """A drafter whose server half reads layer outputs: the session captures them in its tree
    forwards, and every row the Verdicts carry equals the server half over a plain causal
    forward of the committed text (what training saw); the text equals plain greedy."""
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.decoding.server_decoding import decode_in_process
    from shared.messages import OpenRequest

    from cloud_server.engine.layer_outputs import LayerOutputs

    directory = tiny_drafter_dir / name
    server = ServerActivations.load(directory, tiny_target.model)
    assert server.hidden_layers
    bundle = build_bundle(directory, tiny_target.model, "tiny-llama",
                          tmp_path_factory.mktemp(name))
    drafter = trained_drafter(bundle, DrafterName.MOA, TreeSearch(max_depth=6, beam=4, branch=4),
                              precision=Precision.FP32)
    request = OpenRequest(prompt_ids=tuple(PROMPT), max_new_tokens=32)
    run = decode_in_process(tiny_target, request, drafter, 16, server)
    tokens = [t for v in run.verdicts for t in v.tokens]
    assert tokens == plain_greedy(tiny_target, PROMPT, len(tokens))
    assert len(tokens) > len(run.verdicts)  # drafts were accepted
    sent = {}
    for verdict in run.verdicts:
        if verdict.activations is not None:
            start = verdict.activations.start
            sent |= {start + i: row for i, row in enumerate(verdict.activations.values)}
    text = PROMPT + tokens
    # every committed position but the last (the bonus, never forwarded); a last forward
    # whose accepted drafts ran past max_new_tokens may send rows beyond
    assert sorted(sent)[: len(text) - 1] == list(range(len(text) - 1)), sorted(sent)
    with torch.inference_mode(), LayerOutputs(tiny_target.model, server.hidden_layers) as seen:
        tiny_target.model(input_ids=torch.tensor([text[:-1]]))
        expected = server.server(seen.stacked()[0].float()).numpy()  # [len(text) - 1, width]
    np.testing.assert_allclose(np.stack([sent[i] for i in range(len(text) - 1)]).astype(
        np.float32), expected, atol=2e-2 * np.abs(expected).max(), rtol=0)


def test_hidden_input_rows_survive_a_resume_and_a_rebuild(tiny_target, tiny_drafter_dir):
    """Layer outputs are in no cache, so the session keeps every committed position's row: a
    resume that lacks the last verdicts gets the same rows again, and a session rebuilt from
    the history (a server that lost it) computes the same rows by its prefill."""
    from cloud_server.decoding.session import Session
    from shared.draft_q import Proposal
    from shared.messages import ActivationFormat, Limits, OpenRequest, Resume

    server = ServerActivations.load(tiny_drafter_dir / "last", tiny_target.model)
    request = OpenRequest(prompt_ids=tuple(PROMPT), max_new_tokens=16,
                          activations=ActivationFormat.FP16)
    session = Session.open(tiny_target, Limits(), request, server)
    sent = {}
    for verdict in [session.prefill()] + [session.advance(Proposal(DraftTree.chain([30, 31])))
                                          for _ in range(3)]:
        rows = verdict.activations
        sent |= {rows.start + i: row for i, row in enumerate(rows.values)}
    generated = tuple(session.committed[len(PROMPT):])
    again = session.catch_up(Resume(session.id, generated[:2])).activations
    for i, row in enumerate(again.values):
        np.testing.assert_array_equal(row, sent[again.start + i])
    rebuilt = Session.open(tiny_target, Limits(),
                           replace(request, resume=Resume("gone", generated)), server)
    rows = rebuilt.prefill().activations
    assert rows.start == 0
    for position in sorted(sent)[: len(session.committed) - 1]:
        np.testing.assert_allclose(rows.values[position].astype(np.float32),
                                   sent[position].astype(np.float32), atol=1e-2, rtol=0)
