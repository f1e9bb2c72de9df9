"""MoA drafter halves on the tiny model: shapes, and the equivalences training and export rely on
(a whole-sequence forward == incremental steps with explicit K/V; tree-masked drafting == each
path drafted alone; the server's compacted cache holds the K/V a causal forward computes)."""
from __future__ import annotations

import pytest
import torch

from cloud_server.training.boundaries import causal_mask, last_boundary
from cloud_server.moa.config import MoaConfig
from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf, ServerHalf, batch_layer_kv, layer_kv_from_cache
from cloud_server.moa.target_parts import rms_weight
from cloud_server.engine.kv_cache import keep_path
from shared.tree import DraftTree

PROMPT = [5, 17, 42, 99, 7, 61, 33, 8]


def build(tiny_target) -> tuple[MoaConfig, ServerHalf, EdgeHalf]:
    torch.manual_seed(0)
    config = MoaConfig.from_target(tiny_target.model.config)
    return config, ServerHalf(config).eval(), EdgeHalf.from_target(config, tiny_target.model).eval()


def causal_cache(tiny_target, ids: list[int]):
    with torch.inference_mode():
        return tiny_target.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


def activations(tiny_target, config: MoaConfig, server: ServerHalf, ids: list[int]):
    """The server half's output for every position of `ids`: [1, len(ids), width]."""
    return server(batch_layer_kv(causal_cache(tiny_target, ids), config.lsa_layers))


def test_sizes_follow_the_target_config(tiny_target):
    config, server, edge = build(tiny_target)
    assert (config.width, config.target_layers, config.target_kv_width) == (64, 2, 64)
    assert config.lsa_layers == (0, 1)  # every layer, as the paper
    assert MoaConfig.from_target(tiny_target.model.config, lsa_stride=2).lsa_layers == (1,)
    assert all(not name.startswith(("embedding", "head", "final_norm"))
               for name in edge.state_dict())
    layer_kv = batch_layer_kv(causal_cache(tiny_target, PROMPT), config.lsa_layers)
    assert layer_kv.shape == (1, len(PROMPT), 2, 64)
    with torch.no_grad():
        assert server(layer_kv).shape == (1, len(PROMPT), 64)
        assert server(layer_kv[0]).shape == (len(PROMPT), 64)


def test_compacted_cache_holds_causal_kv(tiny_target):
    tree = DraftTree(tokens=(10, 11, 12, 13), parents=(-1, -1, 1, 2))
    cache, _ = tiny_target.prefill(PROMPT)
    tiny_target.forward_tree(cache, 30, tree)
    keep_path(cache, len(PROMPT), (1, 2, 3))
    committed = PROMPT + [30, 11, 12, 13]
    layers = (0, 1)
    expected = batch_layer_kv(causal_cache(tiny_target, committed), layers)[0]  # [n, L, kvw]
    got = layer_kv_from_cache(cache, layers, 0, len(committed))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_incremental_steps_match_whole_sequence(tiny_target):
    """The edge's way (SA K/V kept, memory growing as rounds are verified) equals training's."""
    config, server, edge = build(tiny_target)
    ids = PROMPT + [30, 11, 12, 13, 14, 15]
    with torch.no_grad():
        acts = activations(tiny_target, config, server, ids)  # [1, T, width]
        b = last_boundary(len(PROMPT), len(ids), every=3, phase=1)  # [T]
        ca = additive_mask(torch.arange(len(ids))[None] <= b[:, None])[None, None]
        whole = edge(torch.tensor([ids]), acts, causal_mask(len(ids)), ca)[0][0]  # [T, width]
        positions = torch.arange(len(ids))
        sa_k, sa_v = edge.sa_kv(torch.tensor([ids]), positions)  # [1, kvh, T, hd]
        for i in range(len(PROMPT), len(ids)):
            seen = int(b[i]) + 1
            mem_k, mem_v = edge.memory_kv(acts[:, :seen], positions[:seen])
            step = edge.hidden(torch.tensor([[ids[i]]]), positions[i:i + 1],
                               sa_k[:, :, :i + 1], sa_v[:, :, :i + 1],
                               torch.zeros(1, 1, 1, i + 1), mem_k, mem_v, None)
            torch.testing.assert_close(step[0, 0], whole[i], atol=1e-4, rtol=1e-4)


def test_tree_masked_queries_match_their_paths(tiny_target):
    config, server, edge = build(tiny_target)
    tree = DraftTree(tokens=(10, 11, 12, 13, 14), parents=(-1, -1, 0, 1, 3))
    base = len(PROMPT)
    with torch.no_grad():
        acts = activations(tiny_target, config, server, PROMPT)  # [1, base, width]
        mem = edge.memory_kv(acts, torch.arange(base))
        ctx = torch.tensor([PROMPT])
        nodes = torch.tensor([tree.tokens])
        node_pos = torch.as_tensor(base + tree.depths())  # [n]
        k0, v0 = edge.sa_kv(ctx, torch.arange(base))
        k1, v1 = edge.sa_kv(nodes, node_pos)
        allowed = torch.cat((torch.ones(len(tree), base, dtype=torch.bool),
                             torch.tensor(tree.ancestor_mask())), dim=1)
        got = edge.hidden(nodes, node_pos, torch.cat((k0, k1), 2), torch.cat((v0, v1), 2),
                          additive_mask(allowed)[None, None], *mem, None)[0]  # [n, width]
        for node in range(len(tree)):
            path = PROMPT + tree.path_tokens(node)
            positions = torch.arange(len(path))
            k, v = edge.sa_kv(torch.tensor([path]), positions)
            want = edge.hidden(torch.tensor([path[-1:]]), positions[-1:], k, v,
                               torch.zeros(1, 1, 1, len(path)), *mem, None)[0, 0]
            torch.testing.assert_close(got[node], want, atol=1e-4, rtol=1e-4)


def test_sa_started_from_the_target_computes_its_first_layer(tiny_target):
    config, _, edge = build(tiny_target)
    edge.init_from_target(tiny_target.model)
    ids = torch.tensor([PROMPT])
    positions = torch.arange(len(PROMPT))
    with torch.no_grad():
        keys, values = edge.sa_kv(ids, positions)
        mine = edge.sa(edge.embedding[ids], positions, keys, values, causal_mask(len(PROMPT)))
        theirs = tiny_target.model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_a_final_norm_the_drafter_cannot_share_is_refused():
    """The edge half reproduces an RMSNorm (weight or 1 + weight), not a LayerNorm."""
    with pytest.raises(ValueError, match="LayerNorm is not an RMSNorm"):
        rms_weight(torch.nn.LayerNorm(8), 1e-6)


def test_grouped_attention_equals_each_head_against_its_kv_head():
    """Query heads stacked against their shared K/V head give what each head computes alone
    against a copy of it (the textbook grouped-query attention), masks included."""
    from cloud_server.moa.layers import Attention, Rotary
    from testkit.copied_kv_attention import copied_kv_forward

    torch.manual_seed(0)
    attn = Attention(24, 24, 6, 2, 8, Rotary(8, 10000.0))  # 3 query heads per K/V head
    x, source = torch.randn(2, 3, 24), torch.randn(2, 5, 24)
    positions = torch.arange(5)
    keys, values = attn.project_kv(source, positions)  # [2, 2, 5, 8]
    allowed = torch.rand(2, 1, 3, 5) > 0.3
    allowed[..., 0] = True
    mask = additive_mask(allowed)
    with torch.no_grad():
        got = attn(x, positions[2:], keys, values, mask)
        want = copied_kv_forward(attn, x, positions[2:], keys, values, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
