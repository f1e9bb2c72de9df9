"""Split greedy decoding against plain greedy decoding, through a running server: what the
equivalence tests of every target and drafter assert."""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import OpenRequest


def assert_split_greedy_is_plain(target: Any, address: str, drafter: str, tree_nodes: int,
                                 prompts: Sequence[Sequence[int]], max_new: int, *,
                                 expect_accepted: bool = True, **options: Any) -> None:
    """Each prompt's split greedy output through the server at `address` is the target's
    plain greedy output (the near-tie rule), and drafts were sent; with `expect_accepted`,
    some draft was accepted too: right for a drafter that accepts by construction (pld or
    aded on a repetitive prompt), not for a briefly trained one, whose drafts depend on what
    it learnt on this CPU's kernels. `options`: more ClientOptions (tree="designed")."""
    async def generate() -> list:
        async with EdgeClient(address, ClientOptions(drafter, tree_nodes, max_new,
                                                     **options)) as client:
            return [await client.generate(OpenRequest(prompt_ids=tuple(p),
                                                      max_new_tokens=max_new))
                    for p in prompts]

    results = asyncio.run(generate())
    for prompt, result in zip(prompts, results):
        plain = plain_greedy(target, prompt, max_new)
        verdict = compare(target, prompt, result.output_ids, plain)
        assert verdict.lossless, (prompt, verdict, result.output_ids, plain)
    assert sum(r.drafted_tokens for r in results) > 0, "no draft was ever sent"
    if expect_accepted:
        assert sum(r.accepted_tokens for r in results) > 0, "no draft was ever accepted"
