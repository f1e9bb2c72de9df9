"""Self-distillation of the MoA drafter from the frozen target (paper section 4, docs/architecture.md, Drafters).

Per batch: the target runs once over prompt + its own answer (no grad) and gives every
position's server-half input (per-layer K/V, or chosen layers' outputs: MoaConfig.server_input)
and its last hidden state after the final norm. The server half turns its input into
activations, the edge half reads the token embeddings and the activations up to a random
verified boundary (boundaries.py), and the loss is

    kl_weight * KL(p || q) + feature_weight * SmoothL1(h_drafter, h_target)

over answer positions, where p and q are the target's and the drafter's next-token
distributions through the same shared head (the paper weighs its cross-entropy 0.1 and its
feature loss 1; here both weigh 1 by default because acceptance is judged on the argmax).

A recurrent student (`recurrent`) is trained as it drafts instead (unroll.py): its loss is the
mean over draft depths 1 .. `unroll` of the same loss, every answer position at every depth.
With `block` > 1 every student is Falcon's semi-autoregressive drafter instead, drafting that
many tokens per step and trained with Coupled Sequential Glancing Distillation (sar.py).

`server_inputs` lists one MoA student per server-half input, and with `independent` the paper's
"Independent" baseline trains alongside: the same edge network whose Cross-Attention reads the
verified tokens' own embeddings instead of the server half's activations (Memory.EMBEDDINGS).
All students see the same batches, boundaries and teacher pass, which makes them an ablation.
They share no parameter, so one optimizer over all with the losses summed trains each exactly
as alone; gradients are clipped per student.
Knows nothing of where the samples come from (data.py) or of the command line (cli.py).
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shared import progress
from cloud_server.training.batches import Batch, collate, make_batches, rank_vocab
from cloud_server.training.boundaries import causal_mask, cross_mask
from cloud_server.training.distill import distill_loss
from cloud_server.training.features import covers
from cloud_server.training.sar import block_loss
from cloud_server.training.settings import TrainSettings
from cloud_server.training.unroll import unrolled
from torch import nn

from cloud_server.engine.kv_cache import whole_cache
from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.config import MoaConfig, ServerInput
from shared.drafter_bundle import Memory
from cloud_server.training.data import Sample
from cloud_server.moa.model import EdgeHalf, batch_layer_kv, make_server_half
from cloud_server.moa.weights import save_weights

CHECKPOINT = "checkpoint.pt"
INDEPENDENT = "independent"  # the baseline's weights directory inside the run directory
SNAPSHOTS = "snapshots"  # weights part-way through a run, for a learning curve


@dataclass(frozen=True)
class Teacher:
    """What one target pass over a batch gives the students."""

    target_hidden: torch.Tensor  # [b, T, width], after the final norm: the feature loss's target
    layer_kv: dict[int, torch.Tensor]  # layer -> its K/V [b, T, kv_width], for LSA students
    outputs: dict[int, torch.Tensor]  # layer -> its output [b, T, width], for hidden inputs

    def server_input(self, config: MoaConfig) -> torch.Tensor:
        """The server half's input of every position: [b, T, L, in_width]."""
        if config.server_input is ServerInput.LAYER_KV:
            return torch.stack([self.layer_kv[i] for i in config.lsa_layers], dim=2)
        return torch.stack([self.outputs[i] for i in config.hidden_layers], dim=2)

    def state_before_tli(self, config: MoaConfig) -> torch.Tensor | None:
        """The target's state a TLI drafter predicts (its layer L - N - 1's output):
        [b, T, width]; None for a drafter without TLI."""
        if not config.tli_layers:
            return None
        return self.outputs[_layer_before_tli(config)]


def _layer_before_tli(config: MoaConfig) -> int:
    return config.target_layers - config.tli_layers - 1


@torch.no_grad()
def teacher(target: Any, batch: Batch, configs: list[MoaConfig]) -> Teacher:
    """One forward of the target, keeping what the students' server halves read."""
    reading = [c for c in configs if c.uses_activations]
    kv_layers = tuple(sorted({i for c in reading if c.server_input is ServerInput.LAYER_KV
                              for i in c.lsa_layers}))
    hidden_layers = tuple(sorted({i for c in reading for i in c.hidden_layers}
                                 | {_layer_before_tli(c) for c in configs if c.tli_layers}))
    capture = LayerOutputs(target, hidden_layers) if hidden_layers else None
    # every layer's K/V whole: a sliding-window layer's own cache keeps only its window
    cache = whole_cache(target.config, in_place=False) if kv_layers else None
    with capture or nullcontext():
        out = target.model(input_ids=batch.ids, attention_mask=batch.attention,
                           past_key_values=cache, use_cache=cache is not None)
    layer_kv = {}
    if kv_layers:
        stacked = batch_layer_kv(out.past_key_values, kv_layers).float()  # [b, T, L, kv_width]
        layer_kv = {layer: stacked[:, :, slot] for slot, layer in enumerate(kv_layers)}
    outputs = {}
    if capture is not None:
        stacked = capture.stacked().float()  # [b, T, L, width]
        outputs = {layer: stacked[:, :, slot] for slot, layer in enumerate(hidden_layers)}
    return Teacher(out.last_hidden_state.float(), layer_kv, outputs)


def stored_teacher(target: Any, batch: Batch, layers: tuple[int, ...]) -> Teacher:
    """The teacher pass from the batch's stored features (features.py), where they hold the
    last layer: [b, T, L, width] -> per layer [b, T, width], and the last through the target's
    final norm, as its own forward ends."""
    assert batch.features is not None
    outputs = {layer: batch.features[:, :, slot].float() for slot, layer in enumerate(layers)}
    last = outputs[target.config.num_hidden_layers - 1]
    with torch.no_grad():
        final = target.model.norm(last.to(target.dtype)).float()  # [b, T, width]
    return Teacher(final, {}, outputs)


def _others(running: dict[str, float], names: list[str]) -> str:
    """The other students' part of a progress line."""
    return "".join(f"  ({name} kl {running[name + '_kl']:.3f} top1 {running[name + '_top1']:.3f})"
                   for name in names)


def depth_losses(student: "Student", batch: Batch, memory: torch.Tensor,
                 target_hidden: torch.Tensor, settings: TrainSettings
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """A recurrent student's loss at draft depths 1 .. settings.unroll (unroll.py), each over
    the answer positions whose last verified position k back is past the prompt; stats are
    the depths' means, with the deepest depth's top-1 as `top1_deep`."""
    outputs = unrolled(student.edge, student.server, batch.ids, memory, settings.unroll)
    positions = torch.arange(batch.ids.shape[1], device=batch.ids.device)[None]  # [1, T]
    prompt = torch.tensor(batch.prompt_lens, device=batch.ids.device)[:, None]  # [b, 1]
    weights = [settings.depth_weight ** k for k in range(len(outputs))]
    total = torch.zeros((), device=batch.ids.device)
    stats: dict[str, float] = {}
    for k, (output, weight) in enumerate(zip(outputs, weights), start=1):
        valid = batch.select & (positions - k >= prompt - 1)  # [b, T]
        loss, own = distill_loss(student.edge, output[valid], target_hidden[valid], settings)
        total = total + loss * weight / sum(weights)
        stats = {name: stats.get(name, 0.0) + value / len(outputs) for name, value in own.items()}
    return total, stats | {"loss": total.item(), "top1_deep": own["top1"]}


@dataclass
class Student:
    """One drafter being distilled: a MoA drafter (with its server half) or the Independent
    baseline (no server half: its memory is the tokens' embeddings)."""

    name: str  # "" for the first (written to OUT), else its subdirectory and stats prefix
    config: MoaConfig
    server: nn.Module | None
    edge: EdgeHalf

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*(self.server.parameters() if self.server else ()), *self.edge.parameters()]

    def memory(self, ids: torch.Tensor, teacher_pass: Teacher) -> torch.Tensor:
        """ids: [b, T] -> CA memory rows: [b, T, width]"""
        if self.server is None:
            return self.edge.embedding[ids]
        return self.server(teacher_pass.server_input(self.config))

    def state(self) -> dict:
        return {"server": self.server.state_dict() if self.server else None,
                "edge": self.edge.state_dict()}

    def load_state(self, state: dict) -> None:
        if self.server:
            self.server.load_state_dict(state["server"])
        self.edge.load_state_dict(state["edge"])


def settings_variants(target_config: Any, settings: TrainSettings
                      ) -> list[tuple[str, MoaConfig]]:
    """The students a command line's settings ask for: one MoA student per server input (the
    first named "", the others by their input) and, with `independent`, the baseline."""
    if not settings.server_inputs:
        raise ValueError("train at least one MoA student (server_inputs)")
    configs = [MoaConfig.from_target(target_config, draft_vocab=settings.draft_vocab,
                                     lsa_stride=settings.lsa_stride, server_input=server_input,
                                     recurrent=settings.recurrent, block=settings.block,
                                     tli_layers=settings.tli_layers)
               for server_input in settings.server_inputs]
    names = ["", *(c.server_input.value for c in configs[1:])]
    if settings.independent:
        configs.append(replace(configs[0], memory=Memory.EMBEDDINGS, recurrent=False))
        names.append(INDEPENDENT)
    return list(zip(names, configs))


class Trainer:
    """Owns the drafters, their optimizer and the step counter; saves and resumes checkpoints."""

    def __init__(self, target: torch.nn.Module, samples: list[Sample], settings: TrainSettings,
                 out: Path, stop_ids: tuple[int, ...],
                 variants: list[tuple[str, MoaConfig]] | None = None,
                 feature_layers: tuple[int, ...] = ()) -> None:
        """`variants`: (name, config) of each student, the first named "" (written to `out`);
        by default the students `settings` asks for (`settings_variants`). `feature_layers`:
        the decoder layers the samples' stored features hold (features.py); where they give
        every student what it reads, no batch runs the target."""
        self.target, self.samples, self.settings, self.out = target, samples, settings, out
        self.pad = stop_ids[0]
        self.device = next(target.parameters()).device
        torch.manual_seed(settings.seed)
        variants = variants or settings_variants(target.config, settings)
        if not variants or variants[0][0] != "":
            raise ValueError("train at least one student, the first named ''")
        self.config = variants[0][1]
        vocab_ids = None
        if self.config.draft_vocab:
            vocab_ids = rank_vocab(samples, self.config.draft_vocab, stop_ids,
                                   self.config.vocab_size)
        self.students = [self._student(name, config, vocab_ids) for name, config in variants]
        self.feature_layers = feature_layers if covers(feature_layers, [c for _, c in variants]) \
            else ()
        params = [p for student in self.students for p in student.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step_count = 0
        self._epochs: dict[int, list[list[int]]] = {}

    def _student(self, name: str, config: MoaConfig, vocab_ids: torch.Tensor | None) -> Student:
        server = make_server_half(config)
        edge = EdgeHalf.from_target(config, self.target, vocab_ids).to(self.device)
        if self.settings.init_from_target:
            edge.init_from_target(self.target)
        return Student(name, config, server.to(self.device) if server else None, edge)

    @property
    def server(self) -> nn.Module | None:
        return self.students[0].server

    @property
    def edge(self) -> EdgeHalf:
        return self.students[0].edge

    def _lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine decay to a tenth."""
        if step < self.settings.warmup:
            return (step + 1) / self.settings.warmup
        progress = min(1.0, (step - self.settings.warmup)
                       / max(1, self.settings.steps - self.settings.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def batch_for(self, step: int) -> Batch:
        """The batch of a given step: a function of the seed and step, so a resume continues the
        same sequence of batches."""
        epoch, index = divmod(step, len(self._batches(0)))
        return collate([self.samples[i] for i in self._batches(epoch)[index]], self.pad,
                       self.settings.max_len, self.device)

    def _batches(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            settings = self.settings
            self._epochs[epoch] = make_batches(self.samples, settings.batch_tokens,
                                               settings.max_len, settings.seed, epoch)
        return self._epochs[epoch]

    def train_step(self, batch: Batch) -> dict[str, float]:
        if self.feature_layers and batch.features is not None:
            teacher_pass = stored_teacher(self.target, batch, self.feature_layers)
        else:
            teacher_pass = teacher(self.target, batch, [s.config for s in self.students])
        length = batch.ids.shape[1]
        ca = cross_mask(batch.prompt_lens, length, self.generator).to(self.device)
        sa = causal_mask(length).to(self.device)
        total = torch.zeros((), device=self.device)
        stats: dict[str, float] = {}
        target_hidden = teacher_pass.target_hidden[batch.select]  # [n, width]
        for student in self.students:
            memory = student.memory(batch.ids, teacher_pass)
            if student.config.recurrent:
                loss, own = depth_losses(student, batch, memory, teacher_pass.target_hidden,
                                         self.settings)
            elif student.config.block > 1:
                loss, own = block_loss(student.edge, batch.ids, memory,
                                       teacher_pass.target_hidden, batch.select, ca,
                                       self.settings, self.step_count / self.settings.steps,
                                       self.generator)
            else:
                hidden, predicted = student.edge(batch.ids, memory, sa, ca)
                state = teacher_pass.state_before_tli(student.config)
                loss, own = distill_loss(student.edge, hidden[batch.select], target_hidden,
                                         self.settings, predicted[batch.select],
                                         None if state is None else state[batch.select])
            total = total + loss
            prefix = student.name + "_" if student.name else ""
            stats |= {prefix + k: v for k, v in own.items()}
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        for student in self.students:
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.step_count += 1
        stats["positions"] = float(batch.select.sum())
        return stats

    def run(self, log_every: int = 10) -> dict[str, float]:
        """Trains to `settings.steps`; prints progress, checkpoints, writes the weights."""
        start, positions = time.monotonic(), 0
        first, running = self.step_count, dict[str, float]()
        with progress.bar(self.settings.steps, "training", "step", initial=first) as bar:
            while self.step_count < self.settings.steps:
                stats = self.train_step(self.batch_for(self.step_count))
                positions += int(stats.pop("positions"))
                running = {k: 0.9 * running.get(k, v) + 0.1 * v for k, v in stats.items()}
                bar.update()
                bar.set_postfix_str(f"loss {running['loss']:.3f} top1 {running['top1']:.3f}",
                                    refresh=False)
                self._log(running, start, first, positions, log_every)
                if self.step_count % self.settings.checkpoint_every == 0:
                    self.save_checkpoint()
                every = self.settings.snapshot_every
                if every and self.step_count % every == 0 and self.step_count < self.settings.steps:
                    self.save_weights(self.out / SNAPSHOTS / f"step-{self.step_count}")
        self.save_checkpoint()
        self.save_weights(self.out)
        return running

    def save_weights(self, out: Path) -> None:
        """Every student's trained part: the first in `out`, the others in out/<name>."""
        for student in self.students:
            save_weights(out / student.name, student.config, student.server, student.edge)

    def _log(self, running: dict[str, float], start: float, first: int, positions: int,
             log_every: int) -> None:
        """A line every `log_every` steps where no bar is shown (a pipe, a log file)."""
        if not progress.log_lines() or (self.step_count % log_every
                                        and self.step_count != self.settings.steps):
            return
        elapsed = time.monotonic() - start
        left = (self.settings.steps - self.step_count) * elapsed / (self.step_count - first)
        print(f"step {self.step_count}/{self.settings.steps}  "
              f"{positions / elapsed:.0f} tokens/s  loss {running['loss']:.3f}  "
              f"kl {running['kl']:.3f}  feature {running['feature']:.4f}  "
              f"top1 {running['top1']:.3f}{_others(running, [s.name for s in self.students[1:]])}"
              f"  ETA {left / 60:.1f} min",
              file=sys.stderr, flush=True)

    def save_checkpoint(self) -> None:
        state = {"students": [student.state() for student in self.students],
                 "names": [student.name for student in self.students],
                 "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                 "generator": self.generator.get_state(), "step": self.step_count,
                 "settings": asdict(self.settings), "config": self.config.to_dict()}
        staging = self.out / (CHECKPOINT + ".part")
        torch.save(state, staging)
        staging.replace(self.out / CHECKPOINT)

    def load_checkpoint(self) -> None:
        state = torch.load(self.out / CHECKPOINT, map_location=self.device, weights_only=False)
        if MoaConfig.from_dict(state["config"]) != self.config:
            raise ValueError(f"{self.out / CHECKPOINT} was trained with other sizes")
        names = state.get("names", ["", INDEPENDENT][:len(state["students"])])
        if names != [s.name for s in self.students]:
            raise ValueError(f"{self.out / CHECKPOINT} trained the students "
                             f"{', '.join(n or 'main' for n in names)}: resume it with the same "
                             "--server-input and --independent")
        for student, saved in zip(self.students, state["students"]):
            student.load_state(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.generator.set_state(state["generator"])
        self.step_count = state["step"]
