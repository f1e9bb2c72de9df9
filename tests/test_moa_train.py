"""Drafter training on the tiny model: batched answers equal plain greedy decoding, the loss
goes down, a resumed run continues exactly, and training never sees evaluation prompts."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud_server.cli import main as cloud_server_main
from cloud_server.training.data import Sample, answer_batch
from shared.drafter_bundle import Memory
from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.model import HiddenFusion
from cloud_server.training.moa import INDEPENDENT, Teacher, Trainer, teacher
from cloud_server.training.settings import TrainSettings
from cloud_server.moa.weights import load_drafter
from cloud_server.reference import plain_greedy

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66], [1, 70, 71, 72]]
SETTINGS = TrainSettings(steps=40, batch_tokens=128, lr=3e-3, warmup=5, checkpoint_every=1000)


def assert_stored(loaded: torch.Tensor, trained: torch.Tensor) -> None:
    """A matrix as saved and loaded again: int8 on disk, so each entry within half a step of
    its row's scale (the row's largest magnitude over 127)."""
    half_step = trained.detach().abs().amax(dim=1, keepdim=True) / 254  # [rows, 1]
    assert loaded.dtype == torch.float32
    assert ((loaded - trained.detach()).abs() <= half_step * 1.01).all()


@pytest.fixture(scope="module")
def samples(tiny_target) -> list[Sample]:
    answers = answer_batch(tiny_target, PROMPTS, max_new_tokens=24)
    return [Sample(tuple(p), tuple(a)) for p, a in zip(PROMPTS, answers)]


def test_batched_answers_equal_plain_greedy(tiny_target, samples):
    for sample in samples:
        assert list(sample.answer_ids) == plain_greedy(tiny_target, sample.prompt_ids, 24)


def test_answers_resume_by_prompt_ids_whatever_order_the_file_has(tiny_target, samples,
                                                                   tmp_path, monkeypatch):
    """A rerun answers only what the file lacks, even when an earlier run wrote it in another
    order; each window of prompts is answered shortest first."""
    from cloud_server.training import data

    monkeypatch.setattr(data, "SORT_WINDOW", 2)
    path = tmp_path / "answers.jsonl"
    data.generate_answers(tiny_target, [PROMPTS[2], PROMPTS[1]], path, 2, 24)
    data.generate_answers(tiny_target, PROMPTS, path, 1, 24)
    written = data.load_samples(path)
    assert [s.prompt_ids for s in written[2:]] == [tuple(PROMPTS[3]), tuple(PROMPTS[0])]
    by_prompt = sorted(written, key=lambda s: s.prompt_ids)
    assert by_prompt == sorted(samples, key=lambda s: s.prompt_ids)  # each once, as batched


def test_loss_goes_down(tiny_target, samples, tmp_path):
    trainer = Trainer(tiny_target.model, samples, SETTINGS, tmp_path, stop_ids=(2,))
    losses = [trainer.train_step(trainer.batch_for(s))["loss"] for s in range(SETTINGS.steps)]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses


def test_resume_continues_exactly(tiny_target, samples, tmp_path):
    """With a sub-vocabulary head, which the saved weights carry."""
    settings = replace(SETTINGS, steps=4, checkpoint_every=2, draft_vocab=8, independent=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = Trainer(tiny_target.model, samples, settings, tmp_path / "a", stop_ids=(2,))
    straight.run()
    first = Trainer(tiny_target.model, samples, replace(settings, steps=2), tmp_path / "b",
                    stop_ids=(2,))
    first.run()
    resumed = Trainer(tiny_target.model, samples, settings, tmp_path / "b", stop_ids=(2,))
    resumed.load_checkpoint()
    resumed.run()
    for ours, theirs in zip(straight.students, resumed.students, strict=True):
        for name, value in ours.edge.state_dict().items():
            torch.testing.assert_close(theirs.edge.state_dict()[name], value)
    config, server, edge = load_drafter(tmp_path / "b", tiny_target.model)
    assert config.draft_vocab == 8 and edge.vocab_ids[0] == 2  # the stop token always in
    torch.testing.assert_close(edge.vocab_ids, resumed.edge.vocab_ids)
    assert_stored(server.proj.weight, resumed.server.proj.weight)
    torch.testing.assert_close(edge.head, tiny_target.model.lm_head.weight[edge.vocab_ids])
    config, server, edge = load_drafter(tmp_path / "b" / INDEPENDENT, tiny_target.model)
    assert config.memory is Memory.EMBEDDINGS and server is None
    assert_stored(edge.ca.attn.q_proj.weight, resumed.students[1].edge.ca.attn.q_proj.weight)
    with pytest.raises(ValueError, match="--independent"):
        Trainer(tiny_target.model, samples, replace(settings, independent=False),
                tmp_path / "b", stop_ids=(2,)).load_checkpoint()


@pytest.mark.slow
def test_independent_baseline_learns_without_activations(tiny_target, samples, tmp_path):
    """Both students learn; the baseline's memory never touches the server half's output."""
    trainer = Trainer(tiny_target.model, samples, replace(SETTINGS, independent=True), tmp_path,
                      stop_ids=(2,))
    stats = [trainer.train_step(trainer.batch_for(s)) for s in range(SETTINGS.steps)]
    for key in ("loss", "independent_loss"):
        assert sum(s[key] for s in stats[-5:]) < 0.7 * sum(s[key] for s in stats[:5]), key
    ids = trainer.batch_for(0).ids
    nothing = Teacher(torch.zeros(*ids.shape, 1), None, {})  # never read by the baseline
    torch.testing.assert_close(trainer.students[1].memory(ids, nothing),
                               trainer.students[1].edge.embedding[ids])


@pytest.mark.slow
def test_hidden_input_students_learn_from_the_captured_layers(tiny_target, samples, tmp_path):
    """The last-layer and fused students read the target's layer outputs of the same pass;
    they learn, and are written beside the first student under their input's name."""
    inputs = (ServerInput.LAST_HIDDEN, ServerInput.FUSED_HIDDEN)
    trainer = Trainer(tiny_target.model, samples, replace(SETTINGS, server_inputs=inputs),
                      tmp_path, stop_ids=(2,))
    assert [(s.name, s.config.hidden_layers) for s in trainer.students] == [("", (1,)),
                                                                            ("fused", (0, 1))]
    batch = trainer.batch_for(0)
    seen = teacher(tiny_target.model, batch, [s.config for s in trainer.students])
    assert seen.layer_kv == {} and set(seen.outputs) == {0, 1}
    with torch.no_grad():
        out = tiny_target.model.model(input_ids=batch.ids, attention_mask=batch.attention,
                                      output_hidden_states=True)
    # hidden_states[i + 1] is layer i's output, except the last, which transformers norms
    torch.testing.assert_close(seen.outputs[0], out.hidden_states[1].float())
    stats = [trainer.train_step(trainer.batch_for(s)) for s in range(SETTINGS.steps)]
    for key in ("loss", "fused_loss"):
        assert sum(s[key] for s in stats[-5:]) < 0.5 * sum(s[key] for s in stats[:5]), key
    trainer.settings = replace(trainer.settings, steps=trainer.step_count)
    trainer.run()
    config, server, _ = load_drafter(tmp_path / "fused", tiny_target.model)
    assert config.server_input is ServerInput.FUSED_HIDDEN and config.hidden_layers == (0, 1)
    assert isinstance(server, HiddenFusion)


def test_cli_trains_and_writes_the_weights(tiny_model_dir: Path, tmp_path):
    out = tmp_path / "run"
    args = ["train-drafter", "--model", str(tiny_model_dir), "--out", str(out), "--device", "cpu",
            "--max-prompts", "4", "--max-prompt-tokens", "1000", "--max-new-tokens", "8",
            "--steps", "3", "--batch-tokens", "512", "--independent", "--server-input", "last,kv",
            "--snapshot-every", "2", "--kl-weight", "0.1", "--feature-weight", "1"]
    assert cloud_server_main(args) == 0
    snapshot = out / "snapshots" / "step-2"
    assert MoaConfig.load(snapshot / "kv" / "moa_config.json").server_input is ServerInput.LAYER_KV
    assert (snapshot / INDEPENDENT / "moa.safetensors").is_file()
    assert MoaConfig.load(out / "moa_config.json").server_input is ServerInput.LAST_HIDDEN
    assert MoaConfig.load(out / "kv" / "moa_config.json").server_input is ServerInput.LAYER_KV
    assert {"answers.jsonl", "checkpoint.pt", "moa.safetensors", "moa_config.json",
            "training.json"} <= {p.name for p in out.iterdir()}
    assert {"moa.safetensors", "moa_config.json"} <= {p.name for p in (out / INDEPENDENT).iterdir()}
    answered = len((out / "answers.jsonl").read_text().splitlines())
    summary = json.loads((out / "training.json").read_text())
    assert summary["samples"] == answered > 0
    assert (summary["settings"]["kl_weight"], summary["settings"]["feature_weight"]) == (0.1, 1)
    assert cloud_server_main(args) == 1  # a checkpoint is there and --resume was not given
    assert cloud_server_main(args + ["--resume", "--steps", "4"]) == 0


@pytest.mark.parametrize("inputs", ["kv,kv", "hidden", ""])
def test_cli_refuses_unknown_or_repeated_server_inputs(tmp_path, inputs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cloud_server_main(["train-drafter", "--out", str(tmp_path), "--server-input", inputs])
    assert exit_info.value.code == 2 and "--server-input" in capsys.readouterr().err


@pytest.mark.parametrize("weights", [("0", "0"), ("-1", "1")])
def test_cli_refuses_loss_weights_that_train_nothing(tmp_path, weights, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cloud_server_main(["train-drafter", "--out", str(tmp_path), "--kl-weight", weights[0],
                           "--feature-weight", weights[1]])
    assert exit_info.value.code == 2 and "--kl-weight" in capsys.readouterr().err


@pytest.mark.slow
def test_training_prompts_are_not_evaluation_prompts():
    pytest.importorskip("eval_framework")
    from shared import prompt_sets as evaluation
    from cloud_server.training.prompt_sources import SOURCES, ngrams, opening, training_prompts

    train = training_prompts(list(SOURCES))
    assert len(train) > 20000 and len(set(train)) == len(train)
    held = [row["prompt"] for name in evaluation.SETS for row in evaluation.load(name)]
    held_grams = set().union(*map(ngrams, held))
    held_openings = set(map(opening, held))
    assert not any(ngrams(p) & held_grams or opening(p) in held_openings for p in train)


def test_decontamination_drops_near_copies_and_shared_runs():
    from cloud_server.training.prompt_sources import decontaminated

    held = ["Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning "
            "and bakes muffins for her friends every day with four."]
    prompts = ["JANET'S ducks lay 16 eggs, per day!! She eats three for breakfast... or not?",
               "Tell me: she eats three for breakfast every morning and bakes muffins for "
               "her friends every day, right?",  # a 13-word run
               "Janet has ducks. How many eggs are there?"]  # neither
    assert decontaminated(prompts, held) == prompts[2:]


def test_a_torn_json_array_is_read_up_to_its_last_whole_item():
    from cloud_server.training.prompt_sources import english, json_array_items

    text = '[\n {"a": 1},\n {"a": [2, "]"]}, {"a": 3, "b": "cut he'
    assert list(json_array_items(text)) == [{"a": 1}, {"a": [2, "]"]}]
    assert list(json_array_items("[]")) == []
    assert english("How are you?") and not english("Как дела?")




def test_magpie_starts_from_the_opening_of_a_user_turn(tiny_target):
    from cloud_server.training.magpie import user_turn_prefix

    prefix = user_turn_prefix(tiny_target)
    assert tiny_target.tokenizer.decode(prefix) == "<bos>user\n"


@pytest.mark.slow
def test_cli_mixes_sources_and_self_written_prompts_on_the_real_model(tmp_path):
    out = tmp_path / "run"
    args = ["train-drafter", "--out", str(out), "--device", "cpu", "--max-prompts", "12",
            "--prompt-sources", "chitchat,sharegpt", "--magpie", "6", "--max-new-tokens", "8",
            "--steps", "2", "--batch-tokens", "512", "--quiet"]
    assert cloud_server_main(args) == 0
    written = json.loads((out / "magpie.json").read_text())
    assert len(written) == len(set(written)) == 6
    assert len((out / "answers.jsonl").read_text().splitlines()) == 12
