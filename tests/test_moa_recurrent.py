"""The recurrent MoA drafter (EAGLE's recurrence, MoaConfig.recurrent): each token reads the
previous position's feature, the server's activation where verified and its own output
otherwise. Training's unrolled passes, the torch edge half stepped position by position and
the exported graphs on the edge all compute the same thing, and split decoding with it stays
identical to plain greedy decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.activations import ServerActivations
from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.weights import load_drafter
from cloud_server.reference import compare, plain_greedy
from cloud_server.training.unroll import unrolled
from edge_client.drafters.lookup_merge import LookupMerge
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.tree_search import TreeSearch
from shared.drafter_bundle import Precision
from shared.tree import DraftTree
from tests.in_process import split_greedy

PROMPT = [1, 46, 47, 48, 49]


@torch.no_grad()
def stepped(edge, fusion, ids: list[int], acts: torch.Tensor, verified: int) -> torch.Tensor:
    """Reference: one position at a time, each reading position j - 1's activation when
    j - 1 < verified and its own output otherwise; memory = the verified activations.
    ids: [T]; acts: [>= verified, width] -> normed outputs [T, width]."""
    mem = edge.memory_kv(acts[None, :verified], torch.arange(verified))
    keys, values, own, outs = [], [], [], []
    for j, token in enumerate(ids):
        feature = (torch.zeros(acts.shape[1]) if j == 0
                   else acts[j - 1] if j <= verified else own[j - 1])
        x = edge.inputs(torch.tensor([[token]]), feature[None, None])
        k, v = edge.sa_kv_of(x, torch.tensor([j]))
        keys.append(k)
        values.append(v)
        h = edge.raw(x, torch.tensor([j]), torch.cat(keys, 2), torch.cat(values, 2), None,
                     *mem, None)  # [1, 1, width]
        own.append(fusion(h[0, :, None])[0])
        outs.append(edge.normed(h[0, 0]))
    return torch.stack(outs)


def drafter_parts(tiny_target, tiny_recurrent_dir):
    config, fusion, edge = load_drafter(tiny_recurrent_dir, tiny_target.model)
    assert config.recurrent and fusion is not None
    server = ServerActivations.load(tiny_recurrent_dir, tiny_target.model)
    return edge, fusion, server


@pytest.mark.slow
def test_training_passes_equal_drafting_step_by_step(tiny_target, tiny_recurrent_dir):
    """Pass k of unrolled() gives each position what the drafter computes while drafting it
    at depth k; teacher forcing (pass 1 read at depth k) does not."""
    edge, fusion, _ = drafter_parts(tiny_target, tiny_recurrent_dir)
    torch.manual_seed(0)
    ids = PROMPT + [30, 31, 32, 33, 34, 35]
    acts = torch.randn(len(ids), edge.config.width)
    verified = len(PROMPT) + 1  # positions 0..5 verified; 6 is the round's first, 7.. drafted
    want = stepped(edge, fusion, ids, acts, verified)
    with torch.no_grad():
        depths = unrolled(edge, fusion, torch.tensor([ids]), acts[None], passes=4)
    for k, got in enumerate(depths, start=1):
        torch.testing.assert_close(got[0, verified + k - 1], want[verified + k - 1], atol=1e-4,
                                   rtol=1e-4)
    assert not torch.allclose(depths[0][0, verified + 3], want[verified + 3], atol=1e-3)


@pytest.mark.slow
def test_edge_drafts_equal_the_torch_drafter(tiny_target, tiny_recurrent_dir,
                                             tiny_recurrent_bundle):
    """Greedy chains from the ONNX graphs, with the committed text ending at the verified
    boundary (lock-step) and running past it (offline, pipelined), equal the torch drafter."""
    edge, fusion, server = drafter_parts(tiny_target, tiny_recurrent_dir)
    with torch.inference_mode(), LayerOutputs(tiny_target.model, server.hidden_layers) as seen:
        tiny_target.model(input_ids=torch.tensor([PROMPT]))
        acts = server.server(seen.stacked()[0].float()).numpy()  # [len(PROMPT), width]
    drafter = MoaDrafter(MoaGraphs(tiny_recurrent_bundle, Precision.FP32),
                         TreeSearch(max_depth=5, beam=1, branch=1))
    drafter.reset(PROMPT)
    drafter.add_activations(0, acts)
    assert drafter.graphs.recurrent
    # an edge that cannot feed features refuses the bundle by its format
    assert '"format": 2' in (tiny_recurrent_bundle / "bundle.json").read_text()
    for context in (PROMPT + [30], PROMPT + [30, 31, 32]):
        tree = drafter.propose(context, max_nodes=5)
        assert tree == DraftTree.chain(tree.tokens) and len(tree) == 5
        ids = list(context)
        for _ in range(5):
            out = stepped(edge, fusion, ids, torch.from_numpy(acts), len(PROMPT))
            ids.append(int(edge.vocab_ids[edge.logits(out[-1]).argmax()]))
        assert list(tree.tokens) == ids[len(context):]
    # activations arriving for positions it had drafted from its own features: recomputed
    more = np.random.default_rng(0).standard_normal((2, acts.shape[1])).astype(np.float32)
    drafter.add_activations(len(PROMPT), more)
    all_acts = torch.from_numpy(np.concatenate((acts, more)))
    context = PROMPT + [30, 31, 32]
    out = stepped(edge, fusion, context, all_acts, len(PROMPT) + 2)
    assert drafter.propose(context, 1).tokens == (int(edge.vocab_ids[edge.logits(out[-1])
                                                                   .argmax()]),)


@pytest.mark.slow
def test_split_decoding_with_a_recurrent_drafter_equals_plain_greedy(
        tiny_target, tiny_recurrent_dir, tiny_recurrent_bundle):
    _, _, server = drafter_parts(tiny_target, tiny_recurrent_dir)
    """Every round verifies a tree of the recurrent drafter's, and the text is plain greedy's
    (the near-tie rule, cloud_server/reference.py); what it drafts is
    test_edge_drafts_equal_the_torch_drafter's business."""
    graphs = MoaGraphs(tiny_recurrent_bundle, Precision.FP32)
    drafter = LookupMerge(MoaDrafter(graphs, TreeSearch(max_depth=6, beam=4, branch=4)))
    assert graphs.recurrent
    sizes: list[int] = []
    propose = drafter.propose
    drafter.propose = lambda *a: sizes.append(len(t := propose(*a))) or t  # type: ignore
    tokens, _ = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=16)
    plain = plain_greedy(tiny_target, PROMPT, 32)
    verdict = compare(tiny_target, PROMPT, tokens, plain)
    assert verdict.lossless, (verdict, tokens, plain)
    assert sizes and all(sizes), sizes  # with the prompt's rows fed, it always drafts


def test_recurrence_reads_the_last_layer_only(tiny_target):
    with pytest.raises(ValueError, match="recurrent"):
        MoaConfig.from_target(tiny_target.model.config, server_input=ServerInput.FUSED_HIDDEN,
                              recurrent=True)


def test_train_drafter_refuses_recurrence_on_other_inputs(tmp_path, capsys):
    from cloud_server.training.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), "--recurrent", "--server-input", "kv"])
    assert exit_info.value.code == 2
    assert "--recurrent needs --server-input last" in capsys.readouterr().err
