"""One generation on the server: its committed text, KV cache and round bookkeeping.

The committed text is the prompt plus every token the target has agreed to. All of it but the
last token ("pending") is in the KV cache; each round forwards the pending token together with
the draft tree, so the tree's first level is checked against the target's prediction after the
pending token. Runs on the model thread only; knows nothing of gRPC.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from cloud_server.decoding.activation_rows import ActivationSource, RowKeeper
from cloud_server.decoding.admission import SessionSpec, admit
from cloud_server.engine.interface import ForwardJob, Work
from cloud_server.target import TargetModel
from shared.acceptance import (
    Acceptance, AcceptanceMode, accept_exponential_race, accept_greedy, accept_sampled_drafts,
    accept_topk_drafts,
)
from shared.draft_q import NodeQ, Proposal, QRows
from shared.errors import InvalidRequest
from shared.messages import (
    ActivationRows, Done, FinishReason, Limits, OpenRequest, Opened, Pace,
    Resume, Verdict,
)
from shared.sampling import RngStream, round_rng, warp
from shared.tree import DraftTree

# A forward's input tokens and the target's top-k next tokens at each: [inputs, k]
SuccessorsHook = Callable[[Sequence[int], np.ndarray], None]


class Session:
    """A generation from an admitted request (admission.admit): prefill or resume, then one
    verification round after another until the budget or a stop ends it."""

    def __init__(self, spec: SessionSpec, target: TargetModel,
                 activations: ActivationSource | None = None):
        self.id = uuid.uuid4().hex
        self.spec = spec
        self.target = target
        self.prompt_ids = spec.prompt_ids
        self.committed: list[int] = [*spec.prompt_ids, *spec.history]
        self._row_keeper = None if activations is None or spec.activations is None else (
            RowKeeper(activations, spec.activations))
        self.rounds = 0
        # Raised by each takeover (a resume): paced work handed in under an older epoch runs
        # no forward (ForwardBuilder.stepping), so nothing is committed behind a catch-up.
        self.epoch = 0
        self.finish_reason = FinishReason.NOT_FINISHED
        self._cache: DynamicCache | None = None
        self._successors: tuple[int, SuccessorsHook] | None = None

    @classmethod
    def open(cls, target: TargetModel, limits: Limits, request: OpenRequest,
             activations: ActivationSource | None = None) -> Session:
        """Admits `request` (InvalidRequest if it cannot be) and starts its session."""
        return cls(admit(request, target, limits, activations is not None), target, activations)

    def watch_successors(self, k: int, hook: SuccessorsHook) -> None:
        """After every forward, hands `hook` the forward's input tokens and the target's top-k
        next tokens at each, [inputs, k] best first (Token Recycling, decoding/recycling.py)."""
        self._successors = (k, hook)

    def _recycle(self, inputs: Sequence[int], successors: np.ndarray | None) -> None:
        """successors: [len(inputs), k], the target's best next tokens at each input."""
        if self._successors is not None and successors is not None:
            self._successors[1](inputs, successors)

    def _wants(self, job: ForwardJob) -> ForwardJob:
        """`job`, asking the forward for what this session reads of its logits on the host."""
        job.greedy = self.spec.acceptance is AcceptanceMode.GREEDY
        job.successors_k = 0 if self._successors is None else self._successors[0]
        return job

    @property
    def _kv(self) -> DynamicCache:
        """The committed text's KV cache (all but the pending token)."""
        if self._cache is None:
            raise RuntimeError(f"session {self.id} has no cache: prefill it first")
        return self._cache

    @property
    def most_positions(self) -> int:
        """The most its KV cache can hold: prompt, every new token, and a tree."""
        return len(self.prompt_ids) + self.spec.max_new_tokens + self.spec.limits.max_tree_nodes

    @property
    def kv_bytes(self) -> int:
        """The most KV cache this session can hold, in bytes: what admission counts."""
        return self.most_positions * self.target.kv_bytes_per_token

    @property
    def generated(self) -> int:
        return len(self.committed) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.NOT_FINISHED

    def opened(self, resumed: bool = False) -> Opened:
        spec = self.spec
        return Opened(self.id, self.prompt_ids, spec.acceptance, spec.seed, resumed, spec.pace,
                      spec.lead)

    def prefill(self) -> Verdict:
        return self.target.drive(self.prefilling())

    def prefilling(self) -> Work[Verdict]:
        """Round 0: runs the prompt (and a resumed history) and commits the target's next token."""
        start = time.perf_counter()
        self._cache = self.target.new_cache(self.most_positions)
        last, hidden = yield from self.target.prefill_jobs(self._cache, self.committed,
                                                           self._captured_layers(), self._wants)
        self._keep_rows(0, hidden)
        self._recycle(self.committed[-1:], last.successors)
        empty = DraftTree((), ())
        acceptance = self._accept(empty, last, self._q_rows(empty, ()))
        return self._verdict((), self._commit(acceptance.tokens), 0, start)

    def catch_up(self, resume: Resume) -> Verdict:
        """The answer to a resume of this session: the committed tokens the edge lacks."""
        held = self.committed[len(self.prompt_ids):]
        edge = list(resume.generated_ids)
        if held[: len(edge)] != edge:
            raise InvalidRequest(f"resume history of {len(edge)} tokens does not match session "
                                 f"{self.id}")
        # The edge holds activations up to its own pending token, not included, unless rows that
        # trailed a Verdict were lost with the stream (wire.trailing).
        first_row = len(self.prompt_ids) + len(edge) - 1
        if resume.rows_held is not None:
            first_row = min(first_row, resume.rows_held)
        return self._verdict((), tuple(held[len(edge):]), first_row, time.perf_counter())

    def advance(self, proposal: Proposal, queued_at: float | None = None, draft_id: int = 0,
                names_nodes: bool = True) -> Verdict:
        return self.target.drive(self.advancing(proposal, queued_at, draft_id, names_nodes))

    def advancing(self, proposal: Proposal, queued_at: float | None = None, draft_id: int = 0,
                  names_nodes: bool = True) -> Work[Verdict]:
        """Verifies a tree (a client's, validated; or the server's own; empty: a plain decoding
        step), with the q its drafts were sampled from under acceptance sampled-drafts. The
        Verdict names the accepted nodes unless `names_nodes` is False (a tree that is not
        client draft `draft_id` as drawn: the caller names the client's nodes)."""
        tree = proposal.tree
        q_rows = self._q_rows(tree, proposal.q)
        start = time.perf_counter()
        base = len(self.committed) - 1
        job = self._wants(self.target.tree_job(self._kv, self.committed[-1], tree,
                                               self._captured_layers()))
        yield job
        self.rounds += 1
        self._recycle((self.committed[-1], *tree.tokens), job.successors)
        acceptance = self._accept(tree, job, q_rows)
        self.target.keep_path(self._kv, base, acceptance.accepted_nodes)
        kept = [0, *(1 + i for i in acceptance.accepted_nodes)]  # the inputs left in the cache
        self._keep_rows(base, None if job.hidden is None else job.hidden[kept])
        tokens = self._commit(acceptance.tokens)
        accepted = acceptance.accepted_nodes[: len(tokens)] if names_nodes else ()
        return self._verdict(accepted, tokens, base, start, queued_at, draft_id)

    def _verdict(self, accepted: tuple[int, ...], tokens: tuple[int, ...], first_row: int,
                 start: float, queued_at: float | None = None, draft_id: int = 0) -> Verdict:
        """The answer, built once: the committed tokens, and when the session asked for them
        the activations of cache positions first_row .. (all cached); verify_ms includes
        computing those."""
        return Verdict(
            round_id=self.rounds, accepted_nodes=accepted, tokens=tokens,
            committed_length=len(self.committed), finish_reason=self.finish_reason,
            activations=self._activations(first_row),
            queue_ms=0.0 if queued_at is None else 1000 * (start - queued_at),
            verify_ms=1000 * (time.perf_counter() - start), draft_id=draft_id)

    @property
    def paced(self) -> bool:
        return self.spec.pace is not Pace.LOCKSTEP

    def pause_rows(self, paused: bool) -> None:
        """The Verdicts tell the edge to rest, so it wants no activation rows for now, or ask
        for drafts again: the next Verdict then carries every row the pause held back. Paced
        sessions only; in lock-step the edge drafts from the rows of every Verdict."""
        if self._row_keeper is not None and self.paced:
            self._row_keeper.paused = paused

    def _captured_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the activation source reads, if it needs any."""
        return () if self._row_keeper is None else self._row_keeper.source.hidden_layers

    def _keep_rows(self, start: int, hidden: torch.Tensor | None) -> None:
        """Cache positions start.. are verified; `hidden` [cached positions from start, L,
        width]: their captured layer outputs, if the source reads any."""
        if self._row_keeper is not None:
            self._row_keeper.verified(start, self._kv.get_seq_length(), hidden)

    def _activations(self, first: int) -> ActivationRows | None:
        return None if self._row_keeper is None else self._row_keeper.taken(self._kv, first)

    def _q_rows(self, tree: DraftTree, q: tuple[NodeQ, ...]) -> QRows | None:
        if self.spec.acceptance is not AcceptanceMode.SAMPLED_DRAFTS:
            if q:
                raise InvalidRequest(f"q is for acceptance sampled-drafts; this session verifies "
                                     f"with {self.spec.acceptance.value}")
            return None
        return QRows(tree, q, self.target.vocab_size)

    def _accept(self, tree: DraftTree, job: ForwardJob, q: QRows | None = None
                ) -> Acceptance:
        """The session's acceptance rule on the job's logits: [1 + n, vocab]
        (docs/architecture.md, Verification); row 0 predicts the token at position
        len(committed). Greedy reads the argmax the forward gathered (read_to_host)."""
        mode, seed = self.spec.acceptance, self.spec.seed
        if mode is AcceptanceMode.GREEDY:
            assert job.choices is not None  # asked for by _wants
            return accept_greedy(tree, job.choices)
        p = warp(job.logits.cpu().numpy(), self.spec.sampling)  # [1 + n, vocab]
        if mode is AcceptanceMode.EXPONENTIAL_RACE:
            return accept_exponential_race(tree, p, seed, len(self.committed))
        # Keyed by position, which only grows, so no two decisions share random numbers even
        # across a session rebuilt from its history (its round count starts again).
        rng = round_rng(seed, RngStream.VERIFY, len(self.committed))
        if mode is AcceptanceMode.SAMPLED_DRAFTS:
            assert q is not None  # _q_rows builds q under this rule
            return accept_sampled_drafts(tree, p, q, rng, without_replacement=True)
        return accept_topk_drafts(tree, p, rng)

    def _commit(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """Commits what the budget and the stop conditions let through; returns it."""
        tokens = tokens[: self.spec.max_new_tokens - self.generated]
        stop = self.spec.stops.first_stop(tokens, self.committed[len(self.prompt_ids):])
        if stop is not None:
            tokens = tokens[: stop[0] + 1]
            self.finish_reason = stop[1]
        self.committed.extend(tokens)
        if not self.finished and self.generated >= self.spec.max_new_tokens:
            self.finish_reason = self.spec.cap_reason
        return tokens

    def done(self) -> Done:
        return Done(self.finish_reason, self.generated, self.rounds)
