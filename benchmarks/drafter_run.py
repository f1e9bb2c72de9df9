"""The drafter's training run end to end, one script for the CPU rehearsal and the GPU run
(issue 55): the target's answers with their features through the static engine
(cloud_server/training/engine_answers.py), training, the bundle, and benchmarks/moa_tau.py on
the evaluation prompts (never trained on: prompt_sources.py) against the shipped drafter. The
device run changes only --sizes and --device.

The recipe is the variant the ablation favours (`drafter_ablation`: every variant within 0.05
tau greedy, so the cheapest on the server, `last`, at 3-4 ms a round against Layer
Self-Attention's 53-116 ms), trained as it drafts: recurrent, with EAGLE-3's training-time test
(cloud_server/training/unroll.py) over T = --unroll draft depths, so every answer position
trains with its last verified position 1 .. T back and, past the first, its own earlier
outputs as input (the T-step bounded boundary). No batch runs the target: the features
captured while it answered stand in for its pass (cloud_server/training/features.py).

Every stage resumes: the shards skip answered prompts, training continues from its checkpoint
(kill it and rerun the same command), the bundle is cached by content, and a stage's wall time
lands in OUT/run.json. OUT/LOG_entry.md is the results-log entry's draft.

Sizes (--sizes): `rehearsal` (the CPU, minutes), `smoke` (the slow test's) and `h100` (about
6 GPU minutes, by arithmetic): 30k Magpie prompts written at batch 1024 through transformers'
loop (not timed here: the committed run's data stage wrote as many, and 3.75M answer tokens, in
6 minutes), then up to 40k prompts answered 512 at once, ~150 tokens each: 6M answer tokens at
the 58-68k tokens/s projected for 512 sessions (`drafter_pipeline_cpu`), 1.5-1.7 min; training
1500 steps of 16,384 tokens at the committed run's 0.118 s a step (3000 steps in 353 s, its
training.json; one recurrent student's three extra edge passes against a second student and a
teacher pass, which stored features drop), 3 min; model load and graph capture, under a minute.
The bundle and the evaluation run after, on the host's CPU.

    python -m benchmarks.drafter_run --out runs/drafter --sizes rehearsal [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import machine, markdown_table

SHARDS = "shards"
RUN = "run.json"


@dataclass(frozen=True)
class Sizes:
    sources: tuple[str, ...]  # prompt_sources.py's names
    prompts: int  # training prompts at most: the sources' (as many as they hold), then Magpie's
    magpie: int  # prompts written by the target itself, mixed in turn with the sources'
    max_prompt_tokens: int
    max_new_tokens: int
    sessions: int  # answered at once
    shard_samples: int
    steps: int
    batch_tokens: int
    unroll: int  # T: the draft depths trained at
    draft_vocab: int
    checkpoint_every: int
    eval_per_set: int
    eval_new_tokens: int


SIZES = {
    "rehearsal": Sizes(sources=("eval-framework",), prompts=48, magpie=0,
                       max_prompt_tokens=128, max_new_tokens=32, sessions=16, shard_samples=16,
                       steps=24, batch_tokens=1024, unroll=3,
                       draft_vocab=8192, checkpoint_every=8, eval_per_set=1,
                       eval_new_tokens=32),
    # the slow test's: every stage on a handful of prompts and steps
    "smoke": Sizes(sources=("eval-framework",), prompts=6, magpie=0, max_prompt_tokens=128,
                   max_new_tokens=12, sessions=4, shard_samples=4, steps=3, batch_tokens=512,
                   unroll=3, draft_vocab=8192, checkpoint_every=2, eval_per_set=1,
                   eval_new_tokens=8),
    "h100": Sizes(sources=("eval-framework", "sharegpt", "chitchat"), prompts=40000,
                  magpie=30000, max_prompt_tokens=256, max_new_tokens=160,
                  sessions=512, shard_samples=4096, steps=1500, batch_tokens=16384, unroll=4,
                  draft_vocab=8192, checkpoint_every=100, eval_per_set=6, eval_new_tokens=128),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run directory (a rerun resumes)")
    p.add_argument("--sizes", choices=sorted(SIZES), default="rehearsal")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--stop-after", choices=("data", "train", "bundle", "eval"), default="eval",
                   help="the last stage to run")
    p.add_argument("--name", default="drafter_run", help="the evaluation's results file stem")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's CPU threads (0: its default); on a machine shared with other "
                        "jobs one thread is steadier: two wait on each other at every op")
    return p.parse_args(argv)


def load_target(device: str):
    from cloud_server import model_store
    from cloud_server.device import Precision
    from cloud_server.target import TargetModel

    # bf16 on a GPU, fp32 on the CPU, as `cloud-server train-drafter` loads it
    return TargetModel.load(*model_store.resolve("default"), device, precision=Precision.AUTO)


def data(target, sizes: Sizes, out: Path) -> dict:
    """The target's answers and last-layer outputs, in shards under OUT/shards."""
    from cloud_server.training import data as answers, prompt_sources
    from cloud_server.training.engine_answers import (EngineAnswers, answer_engine,
                                                      write_shards)
    from cloud_server.engine.cuda_graphs import Replay
    from cloud_server.training.magpie import synthesize

    texts = prompt_sources.training_prompts(sizes.sources)
    if sizes.magpie:
        cached = out / "magpie.json"
        if not cached.exists():
            cached.write_text(json.dumps(synthesize(target, sizes.magpie, 1024)))
        texts = list(prompt_sources.mixed(texts, json.loads(cached.read_text())))
    texts = texts[:sizes.prompts]
    prompts = answers.encode_prompts(target, texts, sizes.max_prompt_tokens)
    graphs = Replay if target.device.type == "cuda" else None
    engine = answer_engine(target.model, target.device, sizes.sessions,
                           sizes.max_prompt_tokens + sizes.max_new_tokens,
                           sizes.max_prompt_tokens, graphs)
    last = target.model.config.num_hidden_layers - 1
    answering = EngineAnswers(engine, target.stop_token_ids(), (last,), graphs)
    done = write_shards(answering, prompts, out / SHARDS, sizes.max_new_tokens,
                        sizes.shard_samples)
    return {"prompts": len(prompts), "answer_tokens_now": done.answer_tokens,
            "tokens_per_forward_s": round(done.tokens_per_forward_s),
            "forward_s": round(done.forward_s, 1)}


def train(target, sizes: Sizes, out: Path) -> dict:
    from cloud_server.moa.config import ServerInput
    from cloud_server.training.features import load_shards
    from cloud_server.training.moa import CHECKPOINT, Trainer
    from cloud_server.training.settings import TrainSettings

    samples, layers = load_shards(out / SHARDS)
    settings = TrainSettings(steps=sizes.steps, batch_tokens=sizes.batch_tokens,
                             draft_vocab=sizes.draft_vocab, recurrent=True, unroll=sizes.unroll,
                             server_inputs=(ServerInput.LAST_HIDDEN,),
                             checkpoint_every=sizes.checkpoint_every)
    trainer = Trainer(target.model, samples, settings, out, target.stop_token_ids(),
                      feature_layers=layers)
    if (out / CHECKPOINT).exists():
        trainer.load_checkpoint()
        print(f"resumed at step {trainer.step_count}", file=sys.stderr, flush=True)
    final = trainer.run()
    (out / "training.json").write_text(json.dumps(
        {"model_id": target.model_id, "device": str(target.device), "samples": len(samples),
         "answer_tokens": sum(len(s.answer_ids) for s in samples),
         "settings": asdict(settings), "final": final}, indent=1) + "\n")
    return {"samples": len(samples), "answer_tokens": sum(len(s.answer_ids) for s in samples),
            "teacher_pass": not trainer.feature_layers,
            "top1": round(final.get("top1", 0.0), 3), "loss": round(final.get("loss", 0.0), 3)}


def bundle(target, out: Path) -> dict:
    from cloud_server.moa.bundle import build_bundle

    built = build_bundle(out, target.model, target.model_id, out / "bundles")
    return {"bundle": built.name}


def evaluate(sizes: Sizes, out: Path, name: str) -> dict:
    """moa_tau in a process of its own (the 4-bit engine on the CPU, as the ablation)."""
    command = [sys.executable, "-m", "benchmarks.moa_tau", "--drafters",
               f"run={out},moa", "--per-set", str(sizes.eval_per_set), "--max-new-tokens",
               str(sizes.eval_new_tokens), "--weights", "q4", "--name", name]
    subprocess.run(command, check=True)
    from benchmarks.common import RESULTS

    found = json.loads((RESULTS / f"{name}.json").read_text())["drafters"]
    return {label: {"mean_tau": round(found[label]["mean_tau"], 2),
                    "lossless": found[label]["lossless"]} for label in found}


STAGES = ("data", "train", "bundle", "eval")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sizes = SIZES[args.sizes]
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / RUN
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record |= {"sizes": args.sizes, "device": args.device, "settings": asdict(sizes)}
    target = None
    for stage in STAGES[:STAGES.index(args.stop_after) + 1]:
        began = time.monotonic()
        if stage != "eval" and target is None:
            target = load_target(args.device)
        result = {"data": lambda: data(target, sizes, args.out),
                  "train": lambda: train(target, sizes, args.out),
                  "bundle": lambda: bundle(target, args.out),
                  "eval": lambda: evaluate(sizes, args.out, args.name)}[stage]()
        record[stage] = result | {"wall_s": round(time.monotonic() - began, 1)}
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{stage}: {json.dumps(record[stage])}", file=sys.stderr, flush=True)
    (args.out / "LOG_entry.md").write_text(log_entry(args, record))
    return record


def log_entry(args: argparse.Namespace, record: dict) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "none"
    rows = [(stage, record[stage]["wall_s"], ", ".join(f"{k} {v}" for k, v in record[stage].items()
                                                       if k != "wall_s"))
            for stage in STAGES if stage in record]
    return (f"## {args.name}\n\n- Date {time.strftime('%Y-%m-%d')}, commit {commit}; {machine()}\n"
            f"- `python -m benchmarks.drafter_run --out {args.out} --sizes {args.sizes} "
            f"--device {args.device}`\n\n"
            + markdown_table(("stage", "wall s", "result"), rows) + "\n")


if __name__ == "__main__":
    main()
