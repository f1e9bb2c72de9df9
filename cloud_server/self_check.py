"""The startup check for a target outside the families the tests verify.

Every family in VERIFIED passes the equivalence tests on tiny checkpoints
(tests/test_target_families.py). Another architecture is served only if, at load, a short tree
forward gives each node what a causal forward of its own path gives (and, where the server
batches it, a batched forward gives each session what it gets alone); otherwise the server
refuses it with one line naming the architecture and the check that failed. A broken mask or
position shows as a difference of the logits' own size, rounding as one several orders below.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from shared.tree import DraftTree

VERIFIED = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"})
PROMPT_LENGTH = 6
TREE_PARENTS = (-1, -1, 0, 1, 2)  # two branches, one three deep
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}  # x logits' size


class UnverifiedModel(ValueError):
    """The target's architecture failed the startup check."""


class Checked(Protocol):
    """What the check reads of a TargetModel (target.py), which calls it at load: named here
    rather than imported, so the two modules do not import each other."""

    @property
    def model(self) -> Any: ...
    @property
    def model_id(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def batchable(self) -> bool: ...
    @property
    def engine(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...
    def prefill(self, prompt_ids: list[int]) -> tuple[Any, torch.Tensor]: ...
    def forward_tree(self, cache: Any, pending: int, tree: DraftTree) -> torch.Tensor: ...
    def tree_job(self, cache: Any, pending: int, tree: DraftTree) -> Any: ...
    def run(self, jobs: Sequence[Any]) -> None: ...


def check_target(target: Checked) -> None:
    """Raises UnverifiedModel unless the target is in VERIFIED or passes the check."""
    model_type = target.model.config.model_type
    if model_type in VERIFIED or not target.engine.exact_reference:
        return
    try:
        failed = _tree_check(target) or (_batch_check(target) if target.batchable else None)
    except Exception as err:  # an architecture's forward may break in any way on a tree
        failed = f"a tree forward raised {type(err).__name__}: {err}"
    if failed:
        raise UnverifiedModel(f"{target.model_id} ({model_type}) is outside the verified "
                              f"families and failed the startup self-check: {failed}")


def _inputs(target: Checked) -> tuple[list[int], int, DraftTree]:
    vocab = target.vocab_size
    ids = [(7 + 13 * i) % vocab for i in range(PROMPT_LENGTH + 1 + len(TREE_PARENTS))]
    tree = DraftTree(tuple(ids[PROMPT_LENGTH + 1:]), TREE_PARENTS)
    return ids[:PROMPT_LENGTH], ids[PROMPT_LENGTH], tree


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    tolerance = TOLERANCE.get(dtype, TOLERANCE[torch.float16])
    scale = max(1.0, float(expected.abs().max()))
    return float((got.float() - expected.float()).abs().max()) <= tolerance * scale


def _tree_check(target: Checked) -> str | None:
    prompt, pending, tree = _inputs(target)
    cache, _ = target.prefill(prompt)
    logits = target.forward_tree(cache, pending, tree)
    for node in range(len(tree)):
        path = prompt + [pending] + tree.path_tokens(node)
        with torch.inference_mode():
            expected = target.model(input_ids=torch.tensor([path], device=target.device)
                                    ).logits[0, -1]
        if not _close(logits[node + 1], expected, target.model.dtype):
            return f"draft node {node}'s logits in a tree forward differ from its path's own"
    return None


def _batch_check(target: Checked) -> str | None:
    prompt, pending, tree = _inputs(target)
    prompts = [prompt, prompt[: PROMPT_LENGTH // 2]]
    alone = []
    for p in prompts:
        cache, _ = target.prefill(p)
        alone.append(target.forward_tree(cache, pending, tree))
    jobs = [target.tree_job(target.prefill(p)[0], pending, tree) for p in prompts]
    target.run(jobs)
    if not all(_close(job.logits, a, target.model.dtype) for job, a in zip(jobs, alone)):
        return "a batched forward gives a session other logits than its forward alone"
    return None
