"""The edge's round loop: draft a tree, send it, commit what the server verified, repeat.

Knows the drafter and the link, not the CLI. The server is the authority on what is committed;
the edge only ever appends the tokens a Verdict carries.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from edge_client.budget import TreeBudget
from edge_client.drafters.base import Drafter
from edge_client.link import DecodeStream, LinkError, ServerLink
from shared.messages import Done, DraftRequest, FinishReason, OpenRequest, Opened, Verdict
from shared.tree import DraftTree

OnTokens = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    rounds: int = 0  # draft rounds; the prefill is not one
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    verify_s: float = 0.0  # the server's own time verifying, as its Verdicts report
    finish_reason: FinishReason = FinishReason.NOT_FINISHED

    @property
    def tau(self) -> float:
        """Mean tokens committed per draft round (accepted drafts + the target's token)."""
        return (len(self.output_ids) - 1) / self.rounds if self.rounds else 0.0

    @property
    def server_calls(self) -> int:
        return self.rounds + 1

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.wall_s if self.wall_s else 0.0


def fallback_tree(context: Sequence[int]) -> DraftTree:
    """When a drafter has nothing, guess the last token repeats: the round still yields the
    target's own token, at the cost of one extra node in the forward pass."""
    return DraftTree.chain([context[-1]])


async def _expect(stream: DecodeStream, kind: type):
    msg = await stream.recv()
    if not isinstance(msg, kind):
        raise LinkError(f"protocol error: expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def split_generate(link: ServerLink, drafter: Drafter, request: OpenRequest,
                         budget: TreeBudget, on_tokens: OnTokens | None = None
                         ) -> GenerationResult:
    """Runs one generation to its end; `on_tokens` sees each batch of committed ids."""
    start = time.perf_counter()
    stream = link.decode()
    try:
        await stream.send(request)
        opened: Opened = await _expect(stream, Opened)
        result = GenerationResult(prompt_ids=list(opened.prompt_ids))
        context = list(opened.prompt_ids)
        drafter.reset(context)
        verdict: Verdict = await _expect(stream, Verdict)
        result.ttft_s = time.perf_counter() - start
        _commit(result, context, verdict, on_tokens)
        while verdict.finish_reason is FinishReason.NOT_FINISHED:
            tree = drafter.propose(context, budget.nodes()) or fallback_tree(context)
            sent = time.perf_counter()
            await stream.send(DraftRequest(result.rounds + 1, len(context), tree))
            verdict = await _expect(stream, Verdict)
            budget.observe(len(tree), verdict.accepted_nodes,
                           1000 * (time.perf_counter() - sent), verdict.verify_ms)
            drafter.observe(context, tree, verdict.accepted_nodes, verdict.tokens)
            result.rounds += 1
            result.drafted_tokens += len(tree)
            result.accepted_tokens += len(verdict.accepted_nodes)
            _commit(result, context, verdict, on_tokens)
        await _expect(stream, Done)
        await stream.finish()
    finally:
        stream.cancel()
    result.bytes_up, result.bytes_down = stream.bytes_up, stream.bytes_down
    result.finish_reason = verdict.finish_reason
    result.wall_s = time.perf_counter() - start
    return result


def _commit(result: GenerationResult, context: list[int], verdict: Verdict,
            on_tokens: OnTokens | None) -> None:
    if verdict.committed_length != len(context) + len(verdict.tokens):
        raise LinkError(f"protocol error: server holds {verdict.committed_length} tokens, "
                        f"the edge {len(context) + len(verdict.tokens)}")
    context.extend(verdict.tokens)
    result.output_ids.extend(verdict.tokens)
    result.verify_s += verdict.verify_ms / 1000
    if on_tokens is not None:
        on_tokens(list(verdict.tokens))
