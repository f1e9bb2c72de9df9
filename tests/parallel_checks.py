"""What a target split over ranks must give as one process does, checked the same way for each
way of splitting it (tests/test_tensor_parallel*.py): batched generations, split decoding
through the server, and the rows a drafter's server half reads; the tiny target's prompt,
tree and limits they run with."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cloud_server.config import ServerConfig
from cloud_server.reference import compare, plain_greedy
from shared.drafting.base import DrafterName
from shared.messages import Limits, OpenRequest
from shared.tree import DraftTree
from testkit.batched_runs import run_together
from testkit.split_checks import assert_split_greedy_is_plain
from tests.server_harness import ServerThread

PROMPT = [5, 17, 42, 99, 7, 61, 3, 9, 11, 12, 13]
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15, 16, 17), parents=(-1, -1, 0, 0, 1, 2, 5, 4))
LIMITS = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=300, max_new_tokens=64,
                max_sessions=6, session_idle_timeout_s=5)
ROUNDING = dict(atol=1e-5, rtol=0)  # fp32: the ranks' partial sums add in another order


def assert_batched_generations_match(one: Any, split: Any, drafter: DrafterName | None) -> None:
    """Three generations sharing the split target's forwards are each one's plain greedy."""
    prompts = [PROMPT, [9, 8, 7, 6], list(range(20, 32)) * 2]
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=24) for p in prompts]
    outputs, most = run_together(split, requests, drafter)
    assert most > 1, "the sessions never shared a forward"
    for prompt, output in zip(prompts, outputs):
        assert compare(one, prompt, output, plain_greedy(one, prompt, 24)).lossless


def assert_split_server_matches(one: Any, split: Any, limits: Limits) -> None:
    """Split greedy decoding through a server on the split target is one's plain greedy."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], list(range(20, 32)) * 2]
    with ServerThread(split, ServerConfig(limits)) as server:
        assert_split_greedy_is_plain(one, server.address, "pld", 8, prompts, 40)


def assert_drafter_rows_match(one: Any, split: Any, activations: Any) -> None:
    """The rows `activations` (a drafter's server half) reads after a prefill are one's."""
    found = []
    for target in (one, split):
        cache = target.new_cache()
        _, hidden = target.drive(target.prefill_jobs(cache, PROMPT, activations.hidden_layers))
        found.append(activations(cache, 0, len(PROMPT), hidden, dtype=np.float32))
    np.testing.assert_allclose(found[1], found[0], atol=1e-4)


def assert_batch_of_every_shape_matches(pair: tuple[Any, Any], compact_first: bool = False
                                        ) -> None:
    """Rows of 1, 9 and 3 tokens, 4 sessions (a pad row in a static bucket of 4 or 5),
    contexts from 2 to 41, share a forward: each session's logits and captured layers are
    one's. `compact_first`: the first session's tree is verified and its path 1 -> 4 -> 7
    kept before (a compaction that moves entries, on every rank)."""
    prompts = [PROMPT, PROMPT[:2], list(range(40, 80)), [100]]
    trees = [TREE, DraftTree.chain([]), DraftTree.chain([4, 5]), TREE]
    found = []
    for target in pair:
        caches = [target.prefill(prompt)[0] for prompt in prompts]
        if compact_first:
            target.run([target.tree_job(caches[0], 30, TREE)])
            target.keep_path(caches[0], len(PROMPT), (1, 4, 7))
        jobs = [target.tree_job(c, 30, t, capture=(0, 1)) for c, t in zip(caches, trees)]
        target.run(jobs)
        found.append(jobs)
    for mine, theirs in zip(*found):
        torch.testing.assert_close(theirs.logits, mine.logits, **ROUNDING)
        torch.testing.assert_close(theirs.hidden, mine.hidden, **ROUNDING)

