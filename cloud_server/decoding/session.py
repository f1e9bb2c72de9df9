"""One generation on the server: its committed text, KV cache and round bookkeeping.

The committed text is the prompt plus every token the target has agreed to. All of it but the
last token ("pending") is in the KV cache; each round forwards the pending token together with
the draft tree, so the tree's first level is checked against the target's prediction after the
pending token. Runs on the model thread only; knows nothing of gRPC.
"""
from __future__ import annotations

import secrets
import time
import uuid
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from cloud_server.decoding.activation_rows import ActivationSource, RowKeeper
from cloud_server.engine.interface import Work
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

DEFAULT_SAMPLING_MODE = AcceptanceMode.TOPK_DRAFTS
# A forward's input tokens and the target's top-k next tokens at each: [inputs, k]
SuccessorsHook = Callable[[Sequence[int], np.ndarray], None]
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


class Session:
    def __init__(self, target: TargetModel, limits: Limits, request: OpenRequest,
                 activations: ActivationSource | None = None):
        self.id = uuid.uuid4().hex
        self.target = target
        self.limits = limits
        self.prompt_ids = self._prompt_ids(request)
        self.max_new_tokens, self._cap_reason = self._token_budget(request.max_new_tokens)
        self.sampling = request.sampling
        self.acceptance = self._acceptance_mode(request)
        self.seed = secrets.randbits(63) if request.sampling.seed is None else request.sampling.seed
        self._stop_ids = frozenset(target.stop_token_ids()) | self._extra_stop_ids(request)
        self._stop_strings = self._checked_stop_strings(request.stop_strings)
        self.committed: list[int] = list(self.prompt_ids) + self._history(request)
        if request.activations is not None and activations is None:
            raise InvalidRequest(f"this server has no drafter for {target.model_id} and sends "
                                 "no activations: choose a drafter that needs none")
        self.pace = request.pace or Pace.LOCKSTEP  # resolved by the service's pacing policy
        self.lead = request.lead
        self.trailing_rows = request.trailing_rows  # paced: rows may follow a Verdict
        self.acks_rows = request.trailing_rows and request.acks_rows  # ... and are acknowledged
        if request.rows_paused and not self.acks_rows:
            raise InvalidRequest("rows_paused needs trailing_rows and acks_rows: only a client "
                                 "that acknowledges rows can ask for them again")
        self._row_keeper = None if activations is None or request.activations is None else (
            RowKeeper(activations, request.activations, request.rows_paused and self.paced))
        self.rounds = 0
        # Raised by each takeover (a resume): paced work handed in under an older epoch runs
        # no forward (ForwardBuilder.stepping), so nothing is committed behind a catch-up.
        self.epoch = 0
        self.finish_reason = FinishReason.NOT_FINISHED
        self._cache: DynamicCache | None = None
        self._successors: tuple[int, SuccessorsHook] | None = None

    def watch_successors(self, k: int, hook: SuccessorsHook) -> None:
        """After every forward, hands `hook` the forward's input tokens and the target's top-k
        next tokens at each, [inputs, k] best first (Token Recycling, cloud_server/decoding/recycling.py)."""
        self._successors = (k, hook)

    def _recycle(self, inputs: Sequence[int], logits: torch.Tensor) -> None:
        """logits: [len(inputs), vocab]."""
        if self._successors is not None:
            k, hook = self._successors
            hook(inputs, logits.topk(k, dim=-1).indices.cpu().numpy())

    @property
    def _kv(self) -> DynamicCache:
        """The committed text's KV cache (all but the pending token)."""
        if self._cache is None:
            raise RuntimeError(f"session {self.id} has no cache: prefill it first")
        return self._cache

    @property
    def most_positions(self) -> int:
        """The most its KV cache can hold: prompt, every new token, and a tree."""
        return len(self.prompt_ids) + self.max_new_tokens + self.limits.max_tree_nodes

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

    def _prompt_ids(self, request: OpenRequest) -> tuple[int, ...]:
        if request.chat is not None:
            if not request.chat:
                raise InvalidRequest("chat prompt has no messages")
            ids = tuple(self.target.apply_chat_template(request.chat))
        else:
            ids = tuple(request.prompt_ids or ())
        if not ids:
            raise InvalidRequest("prompt is empty")
        if len(ids) > self.limits.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens, the limit is {self.limits.max_prompt_tokens}")
        self._check_ids(ids, "prompt token")
        return ids

    def _token_budget(self, requested: int) -> tuple[int, FinishReason]:
        limit = self.limits.max_new_tokens
        if requested > limit:
            raise InvalidRequest(f"max_new_tokens {requested} is over the server's limit {limit}")
        room = self.target.max_context - len(self.prompt_ids) - self.limits.max_tree_depth - 1
        if room < 1:
            raise InvalidRequest(f"prompt of {len(self.prompt_ids)} tokens leaves no room in the "
                                 f"model's context of {self.target.max_context}")
        wanted = requested or limit
        if room < wanted:
            return room, FinishReason.CONTEXT
        return wanted, FinishReason.LENGTH

    def _history(self, request: OpenRequest) -> list[int]:
        """The generated tokens a resumed generation brings along (replayed by the prefill)."""
        if request.resume is None:
            return []
        history = list(request.resume.generated_ids)
        if len(history) >= self.max_new_tokens:
            raise InvalidRequest(f"resume brings {len(history)} generated tokens; the session "
                                 f"allows {self.max_new_tokens}")
        self._check_ids(history, "resumed token")
        stop = self._first_stop_in(history)
        if stop is not None:
            raise InvalidRequest(f"resume history ends the generation at token {stop[0]} "
                                 f"({stop[1].name.lower()}): a finished generation cannot "
                                 "go on")
        return history

    def _check_ids(self, ids: list[int] | tuple[int, ...], what: str) -> None:
        vocab = self.target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{what} id {bad} is outside [0, {vocab})")

    def _extra_stop_ids(self, request: OpenRequest) -> frozenset[int]:
        self._check_ids(request.stop_token_ids, "stop token")
        return frozenset(request.stop_token_ids)

    @staticmethod
    def _checked_stop_strings(strings: tuple[str, ...]) -> tuple[str, ...]:
        if len(strings) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"{len(strings)} stop strings, the limit is {MAX_STOP_STRINGS}")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in strings):
            raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        return strings

    def _acceptance_mode(self, request: OpenRequest) -> AcceptanceMode:
        mode = request.acceptance
        if mode is None:
            return AcceptanceMode.GREEDY if request.sampling.greedy else DEFAULT_SAMPLING_MODE
        if mode is AcceptanceMode.GREEDY and not request.sampling.greedy:
            raise InvalidRequest("greedy acceptance with temperature > 0: choose a sampling "
                                 "acceptance mode or temperature 0")
        return mode

    def opened(self, resumed: bool = False) -> Opened:
        return Opened(self.id, self.prompt_ids, self.acceptance, self.seed, resumed, self.pace,
                      self.lead)

    def prefill(self) -> Verdict:
        return self.target.drive(self.prefilling())

    def prefilling(self) -> Work[Verdict]:
        """Round 0: runs the prompt (and a resumed history) and commits the target's next token."""
        start = time.perf_counter()
        self._cache = self.target.new_cache(self.most_positions)
        logits, hidden = yield from self.target.prefill_jobs(self._cache, self.committed,
                                                             self._captured_layers())
        self._keep_rows(0, hidden)
        self._recycle(self.committed[-1:], logits[None])
        empty = DraftTree((), ())
        acceptance = self._accept(empty, logits[None], self._q_rows(empty, ()))
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
        job = self.target.tree_job(self._kv, self.committed[-1], tree, self._captured_layers())
        yield job
        self.rounds += 1
        self._recycle((self.committed[-1], *tree.tokens), job.logits)
        acceptance = self._accept(tree, job.logits, q_rows)
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
        return self.pace is not Pace.LOCKSTEP

    def pause_rows(self, paused: bool) -> None:
        """The edge wants no activation rows for now (Draft.rows_paused), or wants them again:
        the next Verdict then carries every row the pause held back. Paced sessions only; in
        lock-step the edge drafts from the rows of every Verdict."""
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
        if self.acceptance is not AcceptanceMode.SAMPLED_DRAFTS:
            if q:
                raise InvalidRequest(f"q is for acceptance sampled-drafts; this session verifies "
                                     f"with {self.acceptance.value}")
            return None
        return QRows(tree, q, self.target.vocab_size)

    def _accept(self, tree: DraftTree, logits: torch.Tensor, q: QRows | None = None
                ) -> Acceptance:
        """The session's acceptance rule on logits: [1 + n, vocab] (docs/architecture.md, Verification); row 0
        predicts the token at position len(committed)."""
        if self.acceptance is AcceptanceMode.GREEDY:
            return accept_greedy(tree, logits.argmax(-1).cpu().numpy())
        p = warp(logits.cpu().numpy(), self.sampling)  # [1 + n, vocab]
        if self.acceptance is AcceptanceMode.EXPONENTIAL_RACE:
            return accept_exponential_race(tree, p, self.seed, len(self.committed))
        # Keyed by position, which only grows, so no two decisions share random numbers even
        # across a session rebuilt from its history (its round count starts again).
        rng = round_rng(self.seed, RngStream.VERIFY, len(self.committed))
        if self.acceptance is AcceptanceMode.SAMPLED_DRAFTS:
            assert q is not None  # _q_rows builds q under this rule
            return accept_sampled_drafts(tree, p, q, rng, without_replacement=True)
        return accept_topk_drafts(tree, p, rng)

    def _commit(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """Commits what the budget and the stop conditions let through; returns it."""
        tokens = tokens[: self.max_new_tokens - self.generated]
        stop = self._first_stop(tokens)
        if stop is not None:
            tokens = tokens[: stop[0] + 1]
            self.finish_reason = stop[1]
        self.committed.extend(tokens)
        if not self.finished and self.generated >= self.max_new_tokens:
            self.finish_reason = self._cap_reason
        return tokens

    def _first_stop(self, tokens: tuple[int, ...]) -> tuple[int, FinishReason] | None:
        """The index of the first of `tokens` (next after the committed text) that ends the
        generation, and why."""
        return self._first_stop_in(tokens, self.committed[len(self.prompt_ids):])

    def _first_stop_in(self, tokens: Sequence[int], generated: Sequence[int] = ()
                       ) -> tuple[int, FinishReason] | None:
        """The first of `tokens` that would end a generation that has produced `generated`. A
        stop string ends it at the token that completes it, as the user would read the text
        (no special tokens)."""
        prefix = list(generated)
        strings = bool(self._stop_strings) and self._has_stop_string(prefix + list(tokens))
        for i, token in enumerate(tokens):
            if token in self._stop_ids:
                return i, FinishReason.STOP_TOKEN
            if strings and self._has_stop_string(prefix + list(tokens[: i + 1])):
                return i, FinishReason.STOP_STRING
        return None

    def _has_stop_string(self, ids: list[int]) -> bool:
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self._stop_strings)

    def done(self) -> Done:
        return Done(self.finish_reason, self.generated, self.rounds)
