"""Self-distillation of the MoA drafter from the frozen target (paper section 4, docs/architecture.md, Drafters).

Per batch: the target runs once over prompt + its own answer (no grad) and gives every
position's per-layer K/V (the server half's input) and its last hidden state after the final
norm. The server half turns the K/V into activations, the edge half reads the token embeddings
and the activations up to a random verified boundary (boundaries.py), and the loss is

    kl_weight * KL(p || q) + feature_weight * SmoothL1(h_drafter, h_target)

over answer positions, where p and q are the target's and the drafter's next-token
distributions through the same shared head (the paper weighs its cross-entropy 0.1 and its
feature loss 1; here both weigh 1 by default because acceptance is judged on the argmax).

With `independent`, the paper's "Independent" baseline trains alongside on the same batches,
boundaries and teacher pass: the same edge network whose Cross-Attention reads the verified
tokens' own embeddings instead of the server half's activations (Memory.EMBEDDINGS). The
students share no parameter, so one optimizer over both with the losses summed trains each
exactly as alone; gradients are clipped per student.
Knows nothing of where the samples come from (data.py) or of the command line (cli.py).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shared import progress
from cloud_server.training.batches import Batch, collate, make_batches, rank_vocab
from cloud_server.training.boundaries import causal_mask, cross_mask
from cloud_server.moa.config import MoaConfig
from shared.drafter_bundle import Memory
from cloud_server.training.data import Sample
from cloud_server.moa.model import EdgeHalf, ServerHalf, batch_layer_kv
from cloud_server.moa.weights import save_weights

CHECKPOINT = "checkpoint.pt"
INDEPENDENT = "independent"  # the baseline's weights directory inside the run directory


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000  # 1.5-2.5 s each for SmolLM2 on this 2-core CPU
    batch_tokens: int = 1024  # padded tokens per batch (prompt + answer)
    max_len: int = 416  # a sequence is cut to this many tokens
    lr: float = 1e-3
    warmup: int = 30
    kl_weight: float = 1.0
    feature_weight: float = 1.0
    draft_vocab: int = 8192  # sub-vocabulary head size (0 or >= the vocab: the full head)
    init_from_target: bool = True  # SA and CA start from the target's first and last layers
    independent: bool = False  # also train the Independent baseline (written to OUT/independent)
    checkpoint_every: int = 50
    seed: int = 0


@torch.no_grad()
def teacher(target: Any, batch: Batch,
            layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_kv: [b, T, L, kv_width] and last hidden state after the final norm: [b, T, width]."""
    out = target.model(input_ids=batch.ids, attention_mask=batch.attention, use_cache=True)
    return batch_layer_kv(out.past_key_values, layers).float(), out.last_hidden_state.float()


def _independent(running: dict[str, float]) -> str:
    """The Independent baseline's part of a progress line, when it trains."""
    if "independent_top1" not in running:
        return ""
    return (f"  (independent kl {running['independent_kl']:.3f} "
            f"top1 {running['independent_top1']:.3f})")


def distill_loss(edge: EdgeHalf, hidden: torch.Tensor, target_hidden: torch.Tensor,
                 settings: TrainSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """hidden, target_hidden: [n, width] at the selected positions -> loss, stats."""
    log_q = edge.logits(hidden).log_softmax(-1)  # [n, vocab]
    with torch.no_grad():
        log_p = edge.logits(target_hidden).log_softmax(-1)  # [n, vocab]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    feature = F.smooth_l1_loss(hidden, target_hidden)
    loss = settings.kl_weight * kl + settings.feature_weight * feature
    top1 = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
    return loss, {"loss": loss.item(), "kl": kl.item(), "feature": feature.item(),
                  "top1": top1.item()}


@dataclass
class Student:
    """One drafter being distilled: the MoA drafter (with its server half) or the Independent
    baseline (no server half: its memory is the tokens' embeddings)."""

    config: MoaConfig
    server: ServerHalf | None
    edge: EdgeHalf

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*(self.server.parameters() if self.server else ()), *self.edge.parameters()]

    def memory(self, ids: torch.Tensor, layer_kv: torch.Tensor) -> torch.Tensor:
        """ids: [b, T], layer_kv: [b, T, L, kv_width] -> CA memory rows: [b, T, width]"""
        return self.server(layer_kv) if self.server else self.edge.embedding[ids]

    def state(self) -> dict:
        return {"server": self.server.state_dict() if self.server else None,
                "edge": self.edge.state_dict()}

    def load_state(self, state: dict) -> None:
        if self.server:
            self.server.load_state_dict(state["server"])
        self.edge.load_state_dict(state["edge"])


class Trainer:
    """Owns the drafters, their optimizer and the step counter; saves and resumes checkpoints."""

    def __init__(self, target: torch.nn.Module, samples: list[Sample], settings: TrainSettings,
                 out: Path, stop_ids: tuple[int, ...]) -> None:
        self.target, self.samples, self.settings, self.out = target, samples, settings, out
        self.pad = stop_ids[0]
        self.device = next(target.parameters()).device
        torch.manual_seed(settings.seed)
        self.config = MoaConfig.from_target(target.config, draft_vocab=settings.draft_vocab)
        vocab_ids = None
        if self.config.draft_vocab:
            vocab_ids = rank_vocab(samples, self.config.draft_vocab, stop_ids,
                                   self.config.vocab_size)
        self.students = [self._student(self.config, vocab_ids)]
        if settings.independent:
            self.students.append(self._student(replace(self.config, memory=Memory.EMBEDDINGS),
                                               vocab_ids))
        params = [p for student in self.students for p in student.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step_count = 0
        self._epochs: dict[int, list[list[int]]] = {}

    def _student(self, config: MoaConfig, vocab_ids: torch.Tensor | None) -> Student:
        server = ServerHalf(config).to(self.device) if config.uses_activations else None
        edge = EdgeHalf.from_target(config, self.target, vocab_ids).to(self.device)
        if self.settings.init_from_target:
            edge.init_from_target(self.target)
        return Student(config, server, edge)

    @property
    def server(self) -> ServerHalf | None:
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
        layer_kv, target_hidden = teacher(self.target, batch, self.config.lsa_layers)
        length = batch.ids.shape[1]
        ca = cross_mask(batch.prompt_lens, length, self.generator).to(self.device)
        sa = causal_mask(length).to(self.device)
        total = torch.zeros((), device=self.device)
        stats: dict[str, float] = {}
        for student, prefix in zip(self.students, ("", "independent_")):
            hidden = student.edge(batch.ids, student.memory(batch.ids, layer_kv), sa, ca)
            loss, own = distill_loss(student.edge, hidden[batch.select],
                                     target_hidden[batch.select], self.settings)
            total = total + loss
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
        self.save_checkpoint()
        for student, out in zip(self.students, (self.out, self.out / INDEPENDENT)):
            save_weights(out, student.config, student.server, student.edge)
        return running

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
              f"top1 {running['top1']:.3f}{_independent(running)}  ETA {left / 60:.1f} min",
              file=sys.stderr, flush=True)

    def save_checkpoint(self) -> None:
        state = {"students": [student.state() for student in self.students],
                 "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                 "generator": self.generator.get_state(), "step": self.step_count,
                 "settings": asdict(self.settings), "config": self.config.to_dict()}
        staging = self.out / (CHECKPOINT + ".part")
        torch.save(state, staging)
        staging.replace(self.out / CHECKPOINT)

    def load_checkpoint(self) -> None:
        state = torch.load(self.out / CHECKPOINT, map_location=self.device, weights_only=False)
        if state["config"] != self.config.to_dict():
            raise ValueError(f"{self.out / CHECKPOINT} was trained with other sizes")
        if len(state["students"]) != len(self.students):
            raise ValueError(f"{self.out / CHECKPOINT} was trained "
                             f"{'with' if len(state['students']) > 1 else 'without'} "
                             "--independent: resume it the same way")
        for student, saved in zip(self.students, state["students"]):
            student.load_state(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.generator.set_state(state["generator"])
        self.step_count = state["step"]
