"""The backbone equivalence: one tree forward gives each node the logits of its own path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_server.engine.layer_outputs import LayerOutputs
from shared.tree import DraftTree

PROMPT = [5, 17, 42, 99, 7, 61]
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17),
                 parents=(-1, -1, 0, 0, 1, 2, 5, 4))


def causal_logits(target, ids: list[int]) -> torch.Tensor:
    """logits: [len(ids), vocab] from a plain causal forward with no cache, on the CPU."""
    with torch.inference_mode():
        ids_on_device = torch.tensor([ids], device=target.device)
        return target.model(input_ids=ids_on_device).logits[0].float().cpu()


def test_tree_forward_matches_each_path(tiny_target):
    pending = 30
    cache, _ = tiny_target.prefill(PROMPT)
    logits = tiny_target.forward_tree(cache, pending, TREE).cpu()  # [1 + n, vocab]
    base = PROMPT + [pending]
    torch.testing.assert_close(logits[0], causal_logits(tiny_target, base)[-1], atol=1e-4, rtol=0)
    for node in range(len(TREE)):
        path = base + TREE.path_tokens(node)
        expected = causal_logits(tiny_target, path)[-1]
        torch.testing.assert_close(logits[node + 1], expected, atol=1e-4, rtol=0)


def test_compacted_cache_continues_like_plain_decoding(tiny_target):
    pending = 30
    cache, _ = tiny_target.prefill(PROMPT)
    tiny_target.forward_tree(cache, pending, TREE)
    accepted = (1, 4, 7)  # 11 -> 14 -> 17
    tiny_target.keep_path(cache, len(PROMPT), accepted)
    assert cache.get_seq_length() == len(PROMPT) + 1 + len(accepted)
    nxt = tiny_target.forward_tree(cache, 3, DraftTree.chain([8])).cpu()
    committed = PROMPT + [pending] + [TREE.tokens[i] for i in accepted] + [3, 8]
    expected = causal_logits(tiny_target, committed)[-2:]
    torch.testing.assert_close(nxt, expected, atol=1e-4, rtol=0)


def test_prefill_returns_last_position_logits(tiny_target):
    _, last = tiny_target.prefill(PROMPT)
    np.testing.assert_allclose(last.cpu().numpy(), causal_logits(tiny_target, PROMPT)[-1].numpy(),
                               atol=1e-4)


def causal_layer_outputs(target, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[len(ids), L, width]: the chosen decoder layers' outputs of a plain causal forward."""
    with torch.inference_mode(), LayerOutputs(target.model, layers) as captured:
        target.model(input_ids=torch.tensor([ids], device=target.device))
    return captured.stacked()[0].cpu()


def test_tree_forward_captures_each_paths_layer_outputs(tiny_target):
    """What the server half reads of an accepted node (hidden-state inputs, the layers the
    engine captures in the tree forward) equals what a causal forward of its path gives, as
    for the logits: training saw the causal ones."""
    pending, layers = 30, (0, 1)
    cache, _ = tiny_target.prefill(PROMPT)
    job = tiny_target.tree_job(cache, pending, TREE, capture=layers)
    tiny_target.run([job])
    assert job.hidden is not None
    tree_outputs = job.hidden.cpu()  # [1 + n, L, width]
    base = PROMPT + [pending]
    torch.testing.assert_close(tree_outputs[0], causal_layer_outputs(tiny_target, base, layers)[-1],
                               atol=1e-4, rtol=0)
    for node in range(len(TREE)):
        expected = causal_layer_outputs(tiny_target, base + TREE.path_tokens(node), layers)[-1]
        torch.testing.assert_close(tree_outputs[node + 1], expected, atol=1e-4, rtol=0)


def test_layer_outputs_refuses_layers_the_target_lacks(tiny_target):
    with pytest.raises(ValueError, match="decoder layers"):
        LayerOutputs(tiny_target.model, (0, 2))
    with pytest.raises(RuntimeError, match="no forward"):
        with LayerOutputs(tiny_target.model, (1,)) as captured:
            pass
        captured.stacked()
