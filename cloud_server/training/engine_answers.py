"""Training answers at the engine's speed: many prompts decoded together through an engine
(cloud_server/engine/interface.py), one token per session a forward, with the layers the
drafter reads captured in the same forward and written beside the ids in shards.

`sessions` sessions decode at once. A finished session's KV slot goes to the next prompt, and
once `refill` slots are free their prompts are prefilled in the next forward beside the
decoding steps (continuous batching, as vLLM's scheduler keeps its batch full), so the batch
stays full until the prompts run out. Greedy, as data.answer_batch: the same answers up to
rounding (a test checks them token for token on the tiny model in fp32).

A shard (`answers-NNNNN.safetensors`) holds whole samples only, so a run cut off part-way
loses at most the sessions in flight: a rerun skips every prompt a shard holds. Its tensors:
`ids` [N] int32 (prompt then answer, sample after sample), `offsets` [n + 1], `prompt_lens`
[n], `layers` [L] (the captured decoder layers) and `hidden` [N, L, width] bf16, the layers'
outputs at every position. The last position of each sample was never run (its token ends the
answer) and holds zeros, which no loss reads (batches.collate selects positions before it).

Knows nothing of the drafter or the loss; the trainer reads shards through features.py.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cloud_server.engine.buckets import Buckets
from cloud_server.engine.cuda_graphs import Rehearsal, Replay, capture_or_none
from cloud_server.engine.interface import ForwardJob
from cloud_server.engine.static_engine import SlotPlan, StaticEngine
from cloud_server.engine.static_llama import pack
from shared import progress

SHARD_GLOB = "answers-*.safetensors"
Graphs = type[Replay] | type[Rehearsal] | None
STORED_DTYPE = torch.bfloat16  # bf16's range holds any activation; half of fp32's bytes


@dataclass(frozen=True)
class Throughput:
    """What the target did: answer tokens written, and the time inside its forwards."""

    answer_tokens: int
    forwards: int
    forward_s: float
    wall_s: float
    sessions: int  # the batch: sessions decoding at once

    @property
    def tokens_per_forward_s(self) -> float:
        return self.answer_tokens / self.forward_s if self.forward_s else 0.0


def answer_engine(model: Any, device: torch.device, sessions: int, positions: int,
                  prompt_tokens: int, graphs: Graphs = None) -> StaticEngine:
    """The static engine sized for answering: `sessions` KV slots of `positions`, and forwards
    of one token a session (decoding) or up to `prompt_tokens` (prefill), with every power of
    two up to `sessions` as a session bucket (the server's buckets stop at 16 sessions; a
    batch of answers wants one forward for all). `graphs`: Replay (CUDA graphs, a GPU),
    Rehearsal (their contract on the CPU, tests) or None (eager)."""
    rows = sorted({min(1 << k, sessions) for k in range(sessions.bit_length() + 1)})
    contexts = Buckets.up_to(0, positions, 1).contexts
    return StaticEngine(model, device, SlotPlan(sessions, positions, 0), graphs,
                        buckets=Buckets(tuple(rows), (1, prompt_tokens), contexts))


class EngineAnswers:
    """Answers prompts through a static engine (answer_engine), capturing `capture` (decoder
    layers) in each forward. Prefill runs as the engine's ForwardJobs; a decoding step runs
    every slot's row as one forward of the engine's model over its KV pool, with the step's
    inputs built as arrays (a session costs no Python of its own per step) and, with `graphs`,
    replayed from one CUDA graph per context bucket (free slots are pad rows)."""

    def __init__(self, engine: StaticEngine, stop_ids: Sequence[int], capture: tuple[int, ...],
                 graphs: Graphs = None, refill: int | None = None):
        self.engine, self.capture, self.graphs = engine, tuple(capture), graphs
        self.sessions = engine.plan.sessions
        self.refill = refill or max(1, self.sessions // 8)
        self.stops = np.array(sorted(stop_ids))
        self.forward_s, self.forwards = 0.0, 0
        self.forward_cpu_s = 0.0  # this process's CPU time inside the forwards
        pool, width = engine.pool, engine.net.embed.shape[1]
        # rows: [slots, positions, L, width], every position's captured layers, per slot
        self.rows = torch.zeros((self.sessions, pool.positions, len(capture), width),
                                dtype=STORED_DTYPE, device=engine.device)
        self._replays: dict[int, Any] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if graphs is Replay else None

    def answers(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Yields (prompt, answer, hidden [len(prompt) + len(answer), L, width]) as sessions
        finish, in the order they finish."""
        todo = list(reversed([tuple(p) for p in prompts]))
        state = _Slots(self.sessions, max_new_tokens)
        while todo or state.active.any():
            free = self.sessions - len(state.caches)
            if todo and (free >= min(self.refill, len(todo)) or not state.active.any()):
                self._admit(state, [todo.pop() for _ in range(min(free, len(todo)))])
            else:
                self._decode(state)
            yield from self._finish(state, max_new_tokens)

    def _timed(self, forward):
        began, began_cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = forward()  # ends in a device-to-host copy: the GPU is done when it returns
        self.forward_s += time.perf_counter() - began
        self.forward_cpu_s += time.process_time() - began_cpu
        self.forwards += 1
        return out

    def _admit(self, state: "_Slots", prompts: list[tuple[int, ...]]) -> None:
        """Prefills `prompts` in free slots (one engine run) and takes their first tokens."""
        caches = [self.engine.new_cache(len(p) + state.max_new) for p in prompts]
        jobs = [ForwardJob(cache, p, np.arange(len(p)), None, range(len(p) - 1, len(p)),
                           self.capture) for cache, p in zip(caches, prompts)]

        def forward() -> list[int]:
            self.engine.run(jobs, self.capture)
            return torch.stack([job.logits[-1] for job in jobs]).argmax(-1).tolist()

        tokens = self._timed(forward)
        for cache, prompt, job, token in zip(caches, prompts, jobs, tokens):
            slot = cache.slot
            if job.hidden is not None:
                self.rows[slot, :len(prompt)] = job.hidden.to(STORED_DTYPE)
            state.start(slot, cache, prompt, token)

    def _decode(self, state: "_Slots") -> None:
        """One token for every live session in one forward."""
        net, pool = self.engine.net, self.engine.pool
        slots = (np.arange(self.sessions) if self.graphs is not None
                 else np.flatnonzero(state.active))
        live = state.active[slots]  # [S]: false on pad rows
        length = np.where(live, state.length[slots], 0)  # [S]: positions cached
        where = np.where(live, slots, pool.scratch)  # [S]: the slot each row writes and reads
        ints = pack(*(torch.from_numpy(a) for a in (
            np.where(live, state.last[slots], 0)[:, None], length[:, None], where[:, None],
            length[:, None], where, length)))
        tree = torch.from_numpy(live[:, None, None].copy())  # [S, 1, 1]: pads see key 0
        context = int(length.max()) + 1

        def forward() -> np.ndarray:
            final, hidden = self._step(ints, tree, context)  # [S, width], [S, L, width]
            if hidden is not None:
                keep = torch.from_numpy(np.flatnonzero(live)).to(hidden.device)
                at = torch.from_numpy(length[live]).to(hidden.device)
                self.rows[torch.from_numpy(slots[live]).to(hidden.device), at] = \
                    hidden[keep].to(STORED_DTYPE)
            return F.linear(final, net.head).argmax(-1).cpu().numpy()  # [S]

        tokens = self._timed(forward)
        state.advance(slots[live], tokens[live])

    def _step(self, ints: torch.Tensor, tree: torch.Tensor, context: int):
        net, kv, device = self.engine.net, self.engine.pool.kv, self.engine.device
        if self.graphs is None:
            return net.forward(kv, ints.to(device), tree.to(device), context, self.capture)
        bucket = next(c for c in self.engine.buckets.contexts if c >= context)
        if bucket not in self._replays:
            capture = self.capture

            def step(i: torch.Tensor, t: torch.Tensor):
                return net.forward(kv, i, t, bucket, capture)

            self._replays[bucket] = capture_or_none(
                self.graphs, step, ints.to(device), tree.to(device), self._graph_pool,
                f"answers: {self.sessions} sessions over {bucket} positions")
        replay = self._replays[bucket]
        if replay is None:
            return net.forward(kv, ints.to(device), tree.to(device), bucket, self.capture)
        return replay(ints.to(device), tree.to(device))

    def _finish(self, state: "_Slots", max_new_tokens: int):
        """The finished sessions' samples; their slots go back to the pool."""
        done = state.active & (np.isin(state.last, self.stops) | (state.count >= max_new_tokens))
        for slot in np.flatnonzero(done).tolist():
            n = int(state.length[slot])  # prompt + answer - 1: the last token never ran
            hidden = self.rows[slot, :n].cpu() if self.capture else torch.empty(0)
            if self.capture:
                hidden = torch.cat((hidden, torch.zeros_like(hidden[:1])))
            yield state.prompts[slot], state.answers[slot, :state.count[slot]].tolist(), hidden
            state.stop(slot)


class _Slots:
    """The sessions in the engine's KV slots, as arrays indexed by slot."""

    def __init__(self, sessions: int, max_new: int):
        self.max_new = max_new
        self.active = np.zeros(sessions, dtype=bool)
        self.length = np.zeros(sessions, dtype=np.int64)  # positions in the slot's KV
        self.last = np.zeros(sessions, dtype=np.int64)  # the newest token, not yet run
        self.count = np.zeros(sessions, dtype=np.int64)  # answer tokens so far
        self.answers = np.zeros((sessions, max_new), dtype=np.int64)
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.caches: dict[int, Any] = {}  # slot -> its SlotCache, held while the slot is used

    def start(self, slot: int, cache: Any, prompt: tuple[int, ...], token: int) -> None:
        self.caches[slot], self.prompts[slot] = cache, prompt
        self.active[slot], self.length[slot] = True, len(prompt)
        self.last[slot], self.count[slot], self.answers[slot, 0] = token, 1, token

    def advance(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        self.answers[slots, self.count[slots]] = tokens
        self.length[slots] += 1
        self.count[slots] += 1
        self.last[slots] = tokens

    def stop(self, slot: int) -> None:
        self.active[slot] = False
        del self.caches[slot], self.prompts[slot]


def done_prompts(out: Path) -> set[tuple[int, ...]]:
    """The prompts the shards in `out` already hold."""
    done = set()
    for path in sorted(out.glob(SHARD_GLOB)):
        shard = load_file(str(path))
        ids, offsets, prompt_lens = (shard[k].tolist() for k in ("ids", "offsets",
                                                                 "prompt_lens"))
        done |= {tuple(ids[start: start + p]) for start, p in zip(offsets, prompt_lens)}
    return done


def write_shards(answering: EngineAnswers, prompts: Sequence[Sequence[int]], out: Path,
                 max_new_tokens: int, shard_samples: int) -> Throughput:
    """Answers the prompts no shard in `out` holds yet, `shard_samples` samples a shard."""
    out.mkdir(parents=True, exist_ok=True)
    done = done_prompts(out)
    todo = [p for p in prompts if tuple(p) not in done]
    index = len(list(out.glob(SHARD_GLOB)))
    start, produced, pending = time.monotonic(), 0, []
    with progress.bar(len(prompts), "answers", "prompt", initial=len(prompts) - len(todo)) as bar:
        for finished, (prompt, answer, hidden) in enumerate(
                answering.answers(todo, max_new_tokens), start=1):
            pending.append((prompt, answer, hidden))
            produced += len(answer)
            bar.update()
            if len(pending) == shard_samples or finished == len(todo):
                _save_shard(out / f"answers-{index:05d}.safetensors", pending, answering.capture)
                index, pending = index + 1, []
                rate = produced / max(answering.forward_s, 1e-9)
                bar.set_postfix_str(f"{rate:.0f} tokens per forward-second")
                if progress.log_lines():
                    print(f"answers {len(prompts) - len(todo) + finished}/{len(prompts)}  "
                          f"{rate:.0f} tokens per forward-second", file=sys.stderr, flush=True)
    return Throughput(produced, answering.forwards, answering.forward_s,
                      time.monotonic() - start, answering.sessions)


def _save_shard(path: Path, samples: list, capture: tuple[int, ...]) -> None:
    ids = [t for prompt, answer, _ in samples for t in (*prompt, *answer)]
    lengths = [len(prompt) + len(answer) for prompt, answer, _ in samples]
    tensors = {"ids": torch.tensor(ids, dtype=torch.int32),
               "offsets": torch.tensor(np.concatenate(([0], np.cumsum(lengths)))),
               "prompt_lens": torch.tensor([len(p) for p, _, _ in samples], dtype=torch.int32),
               "layers": torch.tensor(capture, dtype=torch.int32),
               "hidden": torch.cat([h for _, _, h in samples]).contiguous()}
    staging = path.with_suffix(".part")
    save_file(tensors, str(staging))
    staging.replace(path)
