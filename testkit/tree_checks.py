"""The backbone equivalence of a target's tree forward: each node gets the logits a causal
forward of its own path gets (transformers' modules, on the same weights)."""
from __future__ import annotations

from typing import Any

import torch

from shared.tree import DraftTree


def causal_logits(target: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] from the target's modules, no cache."""
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([ids], device=target.device)
                            ).logits[0].float()


def assert_tree_forward_is_per_path(target: Any, prompt: list[int], pending: int,
                                    tree: DraftTree, atol: float = 1e-4) -> None:
    """Prefill `prompt`, then one forward of `pending` + `tree`: the prefill's last logits,
    the pending token's and every node's equal their causal forwards'."""
    cache, last = target.prefill(prompt)
    torch.testing.assert_close(last, causal_logits(target, prompt)[-1], atol=atol, rtol=0)
    logits = target.forward_tree(cache, pending, tree)
    base = prompt + [pending]
    torch.testing.assert_close(logits[0], causal_logits(target, base)[-1], atol=atol, rtol=0)
    for node in range(len(tree)):
        expected = causal_logits(target, base + tree.path_tokens(node))[-1]
        torch.testing.assert_close(logits[node + 1], expected, atol=atol, rtol=0)
