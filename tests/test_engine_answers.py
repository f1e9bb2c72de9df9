"""The training data through the static engine (cloud_server/training/engine_answers.py) on the
tiny model: its answers are data.answer_batch's token for token, its stored features are the
target's own pass, a rerun answers only what no shard holds, training from the shards runs no
target forward, and a recurrent run cut off part-way and rerun ends where an uncut one does."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud_server.engine.cuda_graphs import Rehearsal, Replay
from cloud_server.moa.config import ServerInput
from cloud_server.training import moa
from cloud_server.training.batches import collate
from cloud_server.training.data import answer_batch
from cloud_server.training.engine_answers import (SHARD_GLOB, EngineAnswers, answer_engine,
                                                  write_shards)
from cloud_server.training.features import load_shards
from cloud_server.training.moa import Trainer, stored_teacher, teacher
from cloud_server.training.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, *range(40 + i, 44 + i + i % 5)] for i in range(0, 60, 3)]  # 20, 5-9 tokens
SETTINGS = TrainSettings(steps=4, batch_tokens=256, lr=3e-3, warmup=2, draft_vocab=64,
                         checkpoint_every=2, recurrent=True, unroll=3,
                         server_inputs=(ServerInput.LAST_HIDDEN,))


def answering(target, capture=(), sessions: int = 8, refill: int | None = 3,
              graphs: bool = False) -> EngineAnswers:
    """`graphs`: CUDA graphs on a GPU (SPLITDEC_TEST_DEVICE=cuda), their rehearsal here."""
    kind = (Replay if target.device.type == "cuda" else Rehearsal) if graphs else None
    engine = answer_engine(target.model, target.device, sessions, 48, 16, kind)
    return EngineAnswers(engine, target.stop_token_ids(), capture, kind, refill=refill)


@pytest.fixture(scope="module")
def shards(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    last = tiny_target.model.config.num_hidden_layers - 1
    write_shards(answering(tiny_target, (last,)), PROMPTS, out, 24, 6)
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "rehearsed"])
def test_engine_answers_equal_batched_greedy(tiny_target, graphs):
    """More prompts than sessions, slots refilled part-way: each answer is answer_batch's,
    eagerly and under the graphs' contract (padded to buckets, free slots as pad rows)."""
    expected = answer_batch(tiny_target, PROMPTS, 24)
    got = {p: a for p, a, _ in answering(tiny_target, graphs=graphs).answers(PROMPTS, 24)}
    assert [got[tuple(p)] for p in PROMPTS] == expected


def test_stored_features_are_the_targets_own_pass(tiny_target, shards):
    samples, layers = load_shards(shards)
    assert len(samples) == len(PROMPTS) and len(list(shards.glob(SHARD_GLOB))) == 4
    batch = collate(samples[:5], 2, 416, tiny_target.device)
    config = Trainer(tiny_target.model, samples, SETTINGS, shards, (2,)).config
    ran = teacher(tiny_target.model, batch, [config])
    stored = stored_teacher(tiny_target.model, batch, layers)
    rows = batch.select  # what the losses read: every position before a sample's last
    for layer in layers:  # bf16 on disk
        torch.testing.assert_close(stored.outputs[layer][rows], ran.outputs[layer][rows],
                                   atol=0.05, rtol=0.02)
    torch.testing.assert_close(stored.target_hidden[rows], ran.target_hidden[rows],
                               atol=0.05, rtol=0.02)


def test_a_rerun_answers_only_what_no_shard_holds(tiny_target, shards, tmp_path):
    for path in sorted(shards.glob(SHARD_GLOB))[:2]:  # a run cut off after two shards
        (tmp_path / path.name).write_bytes(path.read_bytes())
    kept, _ = load_shards(tmp_path)
    first, _ = load_shards(shards)
    last = tiny_target.model.config.num_hidden_layers - 1
    rerun = write_shards(answering(tiny_target, (last,)), PROMPTS, tmp_path, 24, 6)
    assert len(kept) == 12
    assert rerun.answer_tokens == sum(len(s.answer_ids) for s in first[12:])
    again, _ = load_shards(tmp_path)
    assert sorted(again, key=lambda s: s.prompt_ids) == sorted(first, key=lambda s: s.prompt_ids)


def test_training_from_shards_runs_no_target_forward(tiny_target, shards, tmp_path,
                                                     monkeypatch):
    samples, layers = load_shards(shards)

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher pass ran")

    monkeypatch.setattr(moa, "teacher", refuse)
    trainer = Trainer(tiny_target.model, samples, SETTINGS, tmp_path, (2,), feature_layers=layers)
    stats = [trainer.train_step(trainer.batch_for(s)) for s in range(2)]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in stats)
    assert trainer.step_count == 2


def test_a_recurrent_run_cut_off_and_rerun_ends_where_an_uncut_one_does(tiny_target, shards,
                                                                         tmp_path):
    """What drafter_run does on a rerun: load the checkpoint, train on to the same steps."""
    samples, layers = load_shards(shards)
    (tmp_path / "uncut").mkdir()
    (tmp_path / "cut").mkdir()
    uncut = Trainer(tiny_target.model, samples, SETTINGS, tmp_path / "uncut", (2,),
                    feature_layers=layers)
    uncut.run()
    Trainer(tiny_target.model, samples, replace(SETTINGS, steps=2), tmp_path / "cut", (2,),
            feature_layers=layers).run()  # killed after its step-2 checkpoint
    resumed = Trainer(tiny_target.model, samples, SETTINGS, tmp_path / "cut", (2,),
                      feature_layers=layers)
    resumed.load_checkpoint()
    assert resumed.step_count == 2
    resumed.run()
    assert resumed.step_count == uncut.step_count == SETTINGS.steps
    for name, value in uncut.edge.state_dict().items():
        torch.testing.assert_close(resumed.edge.state_dict()[name], value)


@pytest.mark.slow
def test_the_rehearsal_runs_end_to_end_and_a_rerun_resumes(tmp_path):
    """benchmarks/drafter_run.py on the real target at its smallest sizes (`smoke`): data,
    training, bundle and moa_tau; a rerun finds every stage done (no prompt answered twice,
    training at its last step) and evaluates again."""
    command = [sys.executable, "-m", "benchmarks.drafter_run", "--out", str(tmp_path),
               "--sizes", "smoke", "--threads", "1", "--name", "scratch_drafter_run"]
    try:
        subprocess.run(command + ["--stop-after", "train"], check=True, cwd=ROOT)
        first = json.loads((tmp_path / "run.json").read_text())
        assert first["data"]["answer_tokens_now"] > 0 and not first["train"]["teacher_pass"]
        subprocess.run(command, check=True, cwd=ROOT)
    finally:  # moa_tau writes its tables into the results directory: not a result
        for path in (ROOT / "benchmarks" / "results").glob("scratch_drafter_run.*"):
            path.unlink()
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["data"]["answer_tokens_now"] == 0  # every prompt already in a shard
    drafters = {k: v for k, v in record["eval"].items() if k != "wall_s"}
    assert set(drafters) == {"run", "moa"}
    assert all(r["lossless"][0] == r["lossless"][1] for r in drafters.values())
    assert (tmp_path / "LOG_entry.md").read_text().startswith("## scratch_drafter_run")
