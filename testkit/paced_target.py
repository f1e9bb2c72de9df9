"""A GPU-paced stand-in target: the server's host path around each forward timed as if a GPU
with its graphs captured ran the forwards (issue 63).

On a GPU a small target's forward costs about 1-1.5 ms however many sessions and tree nodes it
carries, so what the server's own Python spends around it decides its capacity. Here the
forward is an engine (cloud_server/engine/interface.py) whose host cost is negligible: its
outputs come from a rule applied to all wanted rows as one array operation, written into a
buffer preallocated as a GPU engine's outputs stay on the device, and then it holds for a fixed
time with the GIL released (time.sleep), as a host waiting on the device does. Everything
else is the product's: TargetModel, the batcher, sessions, pacing, the gRPC service.

The rule (`SuccessorRule`): each token has TOP_K successors, a language's few likely next
words; the token after t at position p is t's successor of a rank drawn by a hash of (t, p),
or with the rest of the probability a word off t's list. So the answer depends only on the
last token and its position: a tree forward gives every node what decoding its path would,
and the answer to a prompt is known in advance (`continuation`), which `RuleOracle` drafts
from at a measured drafter's acceptance. Token Recycling, the server's own drafter, learns
the lists as a real target's successors (its top-8 per row), so server-side speculation
commits a few tokens a forward, not all or none.

Its logits are WIDTH columns, the vocabulary's first ids, not the whole vocabulary: the
session's argmax and top-k over a real row cost this CPU 0.16 ms a row, 20 ms for a 129-row
tree, where a GPU's host pays a launch and a sync; at WIDTH they cost 0.15 ms a tree. It
captures no layer outputs: the methods it serves draft from text (the server half of MoA
is not in the path it measures).

Knows nothing of the wire: benchmarks/paced_server.py serves it, and tests run it in process.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.transformers_engine import kv_elements_per_token
from testkit.profile_oracle import ProfileOracle

TOP_K = 8  # successors a token has, ranked in every row's logits: Token Recycling's k
WIDTH = 256  # logits columns (see the module's docstring)
# P(the token after t is t's successor of rank r), r = 0 .. TOP_K - 1; the rest, 0.53: a word
# off t's list. Token Recycling then commits 1.41 tokens a session-forward in process (64-token
# answers to host_overhead's first 8 prompts), as it did on SmolLM2 in the latency runs
# (results log, `latency_s27_moa`: 0.71 forwards a token).
RANK_SHARES = (0.30, 0.07, 0.04, 0.02, 0.01, 0.01, 0.01, 0.01)
# A row's ranked tokens by the rank of the chosen one: it first, then the rest in list order;
# row TOP_K (off the list): a slot for the word chosen, then the list's first TOP_K - 1.
ORDERS = np.array([[r, *(j for j in range(TOP_K) if j != r)] for r in range(TOP_K)]
                  + [list(range(-1, TOP_K - 1))]) % TOP_K  # [TOP_K + 1, TOP_K]
SCORES = np.arange(TOP_K, 0, -1, dtype=np.float32)  # a row's logits at its ranked tokens
SEED = 0
GPU_KV_BYTES = 2  # bf16, as the GPU node keeps its cache


def _mixed(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 [n]: each output bit depends on every input bit."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


class SuccessorRule:
    """The stand-in's target: the best TOP_K next tokens after a token at a position."""

    def __init__(self, vocab_size: int, excluded: Sequence[int], seed: int = SEED):
        """`excluded`: ids never generated (special tokens: stops, the chat template's)."""
        self.width = min(WIDTH, vocab_size)
        self.words = np.setdiff1d(np.arange(self.width), np.asarray(excluded, dtype=np.int64))
        n = len(self.words)
        if n < 2 * TOP_K:
            raise ValueError(f"{n} ordinary ids below {self.width}: too few for the rule")
        rng = np.random.default_rng(seed)
        # A token's successors lie within a span of `words` starting at a random place,
        # steps below n / TOP_K apart so they are distinct; the words after the span are off
        # its list.
        steps = rng.integers(1, n // TOP_K, size=(vocab_size, TOP_K))
        self._start = rng.integers(n, size=vocab_size)  # [vocab]
        self._offsets = np.cumsum(steps, axis=1)  # [vocab, TOP_K], the last one the span
        self.successors = self.words[(self._start[:, None] + self._offsets) % n]
        self._flat = self.successors.ravel()  # [vocab * TOP_K]
        self._cumulative = np.cumsum(RANK_SHARES)  # [TOP_K]
        self._seed = np.uint64(seed)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> "SuccessorRule":
        """The rule for a target with this tokenizer, whose added tokens it never generates."""
        return cls(vocab_size, sorted(tokenizer.added_tokens_decoder))

    def top(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[n, TOP_K] int64: the best next tokens after each of `tokens` [n] at `positions`
        [n], best first; column 0 is the greedy next token."""
        h = _mixed(tokens.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                   ^ positions.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F) ^ self._seed)
        draw = (h >> np.uint64(11)).astype(np.float64) / 2.0 ** 53  # [n] in [0, 1)
        rank = np.searchsorted(self._cumulative, draw, side="right")  # [n]; TOP_K: off the list
        top = self._flat[tokens[:, None] * TOP_K + ORDERS[rank]]  # [n, TOP_K]
        off = rank == TOP_K
        span = self._offsets[tokens[off], -1]
        past = 1 + _mixed(h[off]) % (len(self.words) - 1 - span).astype(np.uint64)
        top[off, 0] = self.words[(self._start[tokens[off]] + span + past.astype(np.int64))
                                 % len(self.words)]
        return top

    def continuation(self, prompt: Sequence[int], n: int) -> list[int]:
        """The target's greedy answer of `n` tokens to `prompt` (a token's position is its
        index in the text)."""
        text = list(prompt)
        for _ in range(n):
            text.append(int(self.top(np.array(text[-1:]), np.array([len(text) - 1]))[0, 0]))
        return text[len(prompt):]


class PacedCache:
    """A session's KV cache as far as the stand-in keeps one: its length."""

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class PacedEngine:
    """Runs every job of a forward by the rule, then holds `hold_s`. The logits it hands out
    are views of one buffer, overwritten by the next forward, as a captured graph's outputs
    are (the sessions read them before the next forward runs)."""

    batchable = True
    exact_reference = False

    def __init__(self, rule: SuccessorRule, hold_s: float, kv_bytes_per_token: int,
                 rows: int):
        """`rows`: the logits rows to preallocate (a forward of more grows the buffer)."""
        self.rule = rule
        self.hold_s = hold_s
        self._kv_bytes = kv_bytes_per_token
        self._buffer = np.zeros((rows, rule.width), dtype=np.float32)  # [rows, width]
        self._logits = torch.from_numpy(self._buffer)
        self._written = np.zeros(0, np.int64)  # the entries the last forward set, flat

    def describe(self) -> str:
        return (f"GPU-paced stand-in: {1000 * self.hold_s:g} ms a forward, outputs by a "
                f"successor rule, logits {self.rule.width} wide")

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def new_cache(self, most_positions: int | None = None) -> PacedCache:
        return PacedCache()

    def prepare(self, captures: Sequence[tuple[int, ...]], sessions: int = 1) -> None:
        """Nothing to capture: its graph is the rule."""

    def keep_path(self, cache: PacedCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
        cache.length = base + 1 + len(accepted_nodes)

    def run(self, jobs: Sequence[ForwardJob], capture: tuple[int, ...]) -> None:
        if capture:
            raise ValueError("the paced stand-in captures no layer outputs: serve it without a "
                             "drafter that reads them")
        tokens = np.fromiter(itertools.chain.from_iterable(
            job.ids[job.rows.start:job.rows.stop] for job in jobs), dtype=np.int64)
        positions = np.concatenate([job.positions[job.rows.start:job.rows.stop]
                                    for job in jobs])
        logits = self._filled(self.rule.top(tokens, positions))  # [rows, width]
        start = 0
        for job in jobs:
            job.logits = logits[start: start + len(job.rows)]
            start += len(job.rows)
            job.cache.length += len(job.ids)
        time.sleep(self.hold_s)

    def _filled(self, top: np.ndarray) -> torch.Tensor:
        """The buffer's first len(top) rows, each SCORES at its ranked tokens `top` [n,
        TOP_K] and 0 elsewhere (the last forward's entries cleared, not the whole buffer)."""
        n, width = len(top), self.rule.width
        if n > len(self._buffer):
            self._buffer = np.zeros((n, width), dtype=np.float32)
            self._logits = torch.from_numpy(self._buffer)
            self._written = np.zeros(0, np.int64)
        flat = self._buffer.reshape(-1)  # a view
        flat[self._written] = 0.0
        self._written = (np.arange(n)[:, None] * width + top).ravel()  # [n * TOP_K]
        flat[self._written] = np.tile(SCORES, n)
        return self._logits[:n]


class RuleOracle(ProfileOracle):
    """The profile oracle (testkit/profile_oracle.py) drafting from the rule's own answer to
    each prompt: no plain run first."""

    def __init__(self, rule: SuccessorRule, profile: Sequence[float], max_new_tokens: int):
        super().__init__(profile, vocab_size=len(rule.successors))
        self.rule = rule
        self.max_new_tokens = max_new_tokens

    def reset(self, prompt: Sequence[int]) -> None:
        super().reset(prompt)
        self.answer = self.rule.continuation(prompt, self.max_new_tokens)


def paced_target(model_dir: Path, hold_s: float, rows: int) -> Any:
    """A TargetModel of `model_dir`'s config and tokenizer whose engine is the paced one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cloud_server.target import TargetModel

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = PacedEngine(SuccessorRule.of(tokenizer, model.config.vocab_size), hold_s,
                         kv_elements_per_token(model.config) * GPU_KV_BYTES, rows)
    return TargetModel(model, tokenizer, model_dir.name, torch.device("cpu"), engine)


def rule_for(model_dir: Path) -> SuccessorRule:
    """The rule of the stand-in `paced_target` serves from `model_dir`, for its clients."""
    from transformers import AutoConfig, AutoTokenizer

    return SuccessorRule.of(AutoTokenizer.from_pretrained(str(model_dir)),
                            AutoConfig.from_pretrained(str(model_dir)).vocab_size)
