"""Drafters trained briefly on the tiny target at test time, and their fp32 bundles: what the
conftest fixtures and the drafter-family tests build on."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.drafter_bundle import Precision


def train_tiny(target: Any, out: Path, steps: int, **settings: Any) -> Path:
    """A drafter trained briefly on the tiny target's own answers to 8 prompts (sub-vocabulary
    head); `settings` are TrainSettings fields."""
    from cloud_server.training.data import Sample, answer_batch
    from cloud_server.training.moa import Trainer
    from cloud_server.training.settings import TrainSettings

    prompts = [[1, *range(40 + i, 44 + i)] for i in range(0, 48, 6)]
    answers = answer_batch(target, prompts, max_new_tokens=32)
    samples = [Sample(tuple(p), tuple(a)) for p, a in zip(prompts, answers)]
    Trainer(target.model, samples, TrainSettings(steps=steps, batch_tokens=256, lr=3e-3,
                                                 warmup=5, draft_vocab=200,
                                                 checkpoint_every=1000, **settings),
            out, stop_ids=(2,)).run()
    return out


def fp32_bundle(target: Any, drafter_dir: Path, out: Path) -> Path:
    from cloud_server.moa.bundle import build_bundle

    return build_bundle(drafter_dir, target.model, "tiny-llama", out,
                        precisions=(Precision.FP32,))
