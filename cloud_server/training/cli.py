"""`cloud-server train-drafter`: answers the training prompts with the target, then distills.

Everything lands in --out: answers.jsonl (the target's answers, reused by a rerun),
checkpoint.pt (every --checkpoint-every steps; --resume continues from it), and at the end
moa.safetensors + moa_config.json (the trained part, what export.py and the repo take) and
training.json (settings, final losses, timings).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from shared import progress

ANSWERS = "answers.jsonl"
MAGPIE = "magpie.json"
SUMMARY = "training.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from cloud_server.training.settings import TrainSettings

    d = TrainSettings()
    p = argparse.ArgumentParser(prog="cloud-server train-drafter", description=__doc__)
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct, embedded), a hub id or a local path")
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--prompt-sources", default="eval-framework",
                   help="comma-separated, mixed in turn: eval-framework (Arena-Hard, IFEval, "
                        "AlpacaEval, IFBench), sharegpt, chitchat (default %(default)s; "
                        "cloud_server/training/prompt_sources.py)")
    p.add_argument("--magpie", type=int, default=0, metavar="N",
                   help="also N prompts the target writes itself (Magpie; cached in "
                        "OUT/magpie.json), mixed in turn with the sources'")
    p.add_argument("--max-prompts", type=int, default=640,
                   help="use the first N prompts (before dropping those over the length cap)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=160, help="answer length cap")
    p.add_argument("--answer-batch", type=int, default=32, help="prompts answered at once")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="draft head over the N most frequent answer tokens; 0: full vocab")
    p.add_argument("--server-input", default=",".join(i.value for i in d.server_inputs),
                   type=server_inputs,
                   help="what the server half reads, comma-separated to train several "
                        "drafters on the same batches (the first is written to OUT, the others "
                        "to OUT/<input>): kv (per-layer K/V through Layer Self-Attention), last "
                        "(the last layer's output), fused (a low, a middle and the last "
                        "layer's outputs); default %(default)s")
    p.add_argument("--lsa-stride", type=positive, default=d.lsa_stride, metavar="S",
                   help="--server-input kv: Layer Self-Attention over every S-th layer's K/V, "
                        "counting down from the last (default %(default)s: every layer, as the "
                        "MoA paper)")
    p.add_argument("--tli-layers", type=int, choices=range(4), default=d.tli_layers,
                   metavar="N",
                   help="Target Layer Inference: the drafter predicts the target's state N "
                        "layers before the last and the edge runs the target's last N layers "
                        "(0-3; default %(default)s; MoA only, not --recurrent)")
    p.add_argument("--independent", action="store_true",
                   help="also train the paper's Independent baseline on the same batches "
                        "(OUT/independent: the same network reading token embeddings, not "
                        "the target's activations)")
    p.add_argument("--recurrent", action="store_true",
                   help="the MoA drafter also reads the previous position's feature, its own "
                        "output where it drafted that position (EAGLE's recurrence; server "
                        "input 'last' only), trained as it drafts (--unroll)")
    p.add_argument("--unroll", type=positive, default=d.unroll,
                   help="--recurrent: the draft depths it trains at, one pass each "
                        "(default %(default)s)")
    p.add_argument("--depth-weight", type=float, default=d.depth_weight,
                   help="--recurrent: depth k's loss weighs this to the power k - 1 "
                        "(default %(default)s)")
    p.add_argument("--method", choices=("moa", "falcon"), default="moa",
                   help="moa: one token per drafting step; falcon: Falcon's semi-"
                        "autoregressive drafter, --block tokens per step, trained with "
                        "Coupled Sequential Glancing Distillation (default %(default)s)")
    p.add_argument("--block", type=positive, default=2, metavar="K",
                   help="--method falcon: tokens drafted per step (default %(default)s)")
    p.add_argument("--glance", type=float, default=d.glance,
                   help="--method falcon: the glancing rate at the start, falling to a tenth "
                        "of it (default %(default)s; 0: no glancing)")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight,
                   help="weight of KL(target || drafter) in the loss (default %(default)s; "
                        "the MoA paper's: 0.1)")
    p.add_argument("--feature-weight", type=float, default=d.feature_weight,
                   help="weight of the SmoothL1 feature loss (default %(default)s; the MoA "
                        "paper's: 1.0)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--snapshot-every", type=int, default=d.snapshot_every, metavar="N",
                   help="also write the weights every N steps to OUT/snapshots/step-N, for a "
                        "learning curve (0: never)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars and no progress lines")
    args = p.parse_args(argv)
    if args.kl_weight < 0 or args.feature_weight < 0 or not args.kl_weight + args.feature_weight:
        p.error("--kl-weight and --feature-weight must be >= 0, and not both 0")
    if args.recurrent and [i.value for i in args.server_input] != ["last"]:
        p.error("--recurrent needs --server-input last: the drafter feeds its own output back "
                "where the last layer's output goes")
    if args.tli_layers and (args.recurrent or args.method == "falcon"):
        p.error("--tli-layers runs after a one-token drafter that is not --recurrent")
    if args.method == "falcon" and (args.recurrent or args.block < 2):
        p.error("--method falcon drafts --block >= 2 tokens a step from verified activations "
                "only: it takes no --recurrent")
    if not 0 <= args.glance <= 1:
        p.error("--glance is a rate between 0 and 1")
    return args


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def server_inputs(text: str) -> tuple:
    from cloud_server.moa.config import ServerInput

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {i.value for i in ServerInput}
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct names among {', '.join(known)}")
    return tuple(ServerInput(n) for n in names)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.quiet:
        progress.set_quiet()
    from cloud_server import model_store
    from cloud_server.device import Precision
    from cloud_server.target import TargetModel
    from cloud_server.training import data, prompt_sources
    from cloud_server.training.moa import CHECKPOINT, Trainer
    from cloud_server.training.settings import TrainSettings

    if (args.out / CHECKPOINT).exists() and not args.resume:
        print(f"train-drafter: {args.out} holds a checkpoint: pass --resume or another --out",
              file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    model_store.follow_progress_setting()
    path, model_id = model_store.resolve(args.model)
    # bf16 on a GPU (fp32 on the CPU): the answers a drafter learns from need not be exact
    target = TargetModel.load(path, model_id, args.device, precision=Precision.AUTO)
    texts = prompt_sources.training_prompts(args.prompt_sources.split(","))
    if args.magpie:
        texts = list(prompt_sources.mixed(texts, self_written(target, args)))
    prompts = data.encode_prompts(target, texts[:args.max_prompts],
                                  args.max_prompt_tokens)
    answers = args.out / ANSWERS
    data.generate_answers(target, prompts, answers, args.answer_batch, args.max_new_tokens)
    samples = data.load_samples(answers)
    answered = time.monotonic()
    settings = TrainSettings(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                             draft_vocab=args.draft_vocab, checkpoint_every=args.checkpoint_every,
                             snapshot_every=args.snapshot_every,
                             server_inputs=args.server_input, independent=args.independent,
                             lsa_stride=args.lsa_stride, tli_layers=args.tli_layers,
                             recurrent=args.recurrent, unroll=args.unroll,
                             depth_weight=args.depth_weight, kl_weight=args.kl_weight,
                             feature_weight=args.feature_weight, seed=args.seed,
                             block=args.block if args.method == "falcon" else 1,
                             glance=args.glance)
    trainer = Trainer(target.model, samples, settings, args.out, target.stop_token_ids())
    if args.resume and (args.out / CHECKPOINT).exists():
        trainer.load_checkpoint()
        print(f"resumed at step {trainer.step_count}", file=sys.stderr, flush=True)
    stats = trainer.run()
    summary = {"model_id": model_id, "device": str(target.device), "samples": len(samples),
               "answer_tokens": sum(len(s.answer_ids) for s in samples),
               "answer_seconds": round(answered - start, 1),
               "train_seconds": round(time.monotonic() - answered, 1),
               "settings": asdict(settings), "final": stats}
    (args.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def self_written(target, args: argparse.Namespace) -> list[str]:
    """--magpie prompts, written once into the run directory and reused by a rerun."""
    from cloud_server.training.magpie import synthesize

    path = args.out / MAGPIE
    if path.exists():
        cached = json.loads(path.read_text())
        if len(cached) >= args.magpie:
            return cached[:args.magpie]
    prompts = synthesize(target, args.magpie, args.answer_batch, seed=args.seed)
    path.write_text(json.dumps(prompts, indent=0) + "\n")
    return prompts
