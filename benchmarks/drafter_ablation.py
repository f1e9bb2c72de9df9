"""The drafter ablation: which parts of the MoA paper pay, every variant trained on the same
batches and measured on the same evaluation prompts (issue 44).

One training run (cloud_server/training/moa.py) distills every variant side by side from one
target pass per batch, so the batches, the verified boundaries and the steps are the same for
all: the server half reading the last layer's output (`last`, EAGLE's feature) or Layer
Self-Attention over every second layer's K/V (`lsa2`) or every layer's (`lsa1`, the paper's),
each with Target Layer Inference over the target's last 0, 1 or 2 layers (`-tli N`); Falcon's
semi-autoregressive drafter drafting blocks of 2 and 3 (on `last`), each with EAGLE-2's dynamic
tree and with a Custom-Designed Decoding Tree (`+cddt`: a static tree designed from its
measured ranks on held-out training-source prompts, benchmarks/tree_design.py); and the
Independent baseline (the same network blind to the target) as the floor. The training prompts are the project's training
sources, answered greedily by the target and cached in --out; the evaluation prompts are the
evaluation sets (shared/prompt_sets.py), never trained on.

Then benchmarks/moa_tau.py measures every variant in process, greedy and at --temperature,
without lookup nodes: tau, the edge's step time, the bundle's size; the wire carries one
activation row a verified token for every variant but Independent (2 * width bytes in fp16).

    python -m benchmarks.drafter_ablation --out runs/ablation [--steps 150] [--prompts 400]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import moa_tau
from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results

NAME = "drafter_ablation"
MAIN = "last"  # the first student, written to --out itself


def variants(target_config, draft_vocab: int, names: list[str]) -> list[tuple[str, object]]:
    """(name, MoaConfig) of each variant asked for, the first named "" (the trainer's main)."""
    from cloud_server.moa.config import MoaConfig, ServerInput
    from shared.drafter_bundle import Memory

    def config(server_input: ServerInput, **fields) -> MoaConfig:
        return MoaConfig.from_target(target_config, draft_vocab=draft_vocab,
                                     server_input=server_input, **fields)

    last = config(ServerInput.LAST_HIDDEN)
    known = {MAIN: last,
             "independent": replace(last, memory=Memory.EMBEDDINGS),
             "falcon-2": config(ServerInput.LAST_HIDDEN, block=2),
             "falcon-3": config(ServerInput.LAST_HIDDEN, block=3)}
    for tli in (1, 2):
        known[f"last-tli{tli}"] = config(ServerInput.LAST_HIDDEN, tli_layers=tli)
    for stride in (2, 1):
        for tli in (0, 1, 2):
            known[f"lsa{stride}" + (f"-tli{tli}" if tli else "")] = config(
                ServerInput.LAYER_KV, lsa_stride=stride, tli_layers=tli)
    assert set(known) == set(KNOWN)
    return [("" if n == MAIN else n, known[n]) for n in names]


KNOWN = (MAIN, "last-tli1", "last-tli2", "lsa2", "lsa2-tli1", "lsa2-tli2", "lsa1", "lsa1-tli1",
         "lsa1-tli2", "falcon-2", "falcon-3", "independent")
DEFAULT_VARIANTS = ("last,last-tli1,last-tli2,lsa2,lsa1,lsa1-tli1,lsa1-tli2,falcon-2,falcon-3,"
                    "independent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True,
                   help="run directory: answers, checkpoint and every variant's weights")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated, starting with 'last' (default %(default)s)")
    p.add_argument("--prompts", type=int, default=400, help="training prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="training answers' cap")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--per-set", type=int, default=2, help="evaluation prompts per set")
    p.add_argument("--eval-new-tokens", type=int, default=96)
    p.add_argument("--max-nodes", type=int, default=64, help="every variant's tree budget")
    p.add_argument("--calibration-prompts", type=int, default=12,
                   help="held-out training-source prompts a +cddt tree is designed on")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="the sampled evaluation's temperature, beside greedy")
    p.add_argument("--weights", choices=("fp32", "q4"), default="q4",
                   help="the target's weights in the evaluation (moa_tau.py): the 4-bit engine "
                        "by default, 3-4x faster on a CPU, with the same tau (`moa_tau_q4`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=NAME, help="results file stem")
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if args.names[:1] != [MAIN] or set(args.names) - set(KNOWN):
        p.error(f"--variants: start with {MAIN}, then any of {', '.join(KNOWN[1:])}")
    return args


def train(args: argparse.Namespace, names: list[str]) -> dict:
    """Answers the training prompts (cached), trains every variant (resumable); the run's
    summary."""
    from cloud_server import model_store
    from cloud_server.target import TargetModel
    from cloud_server.training import data, prompt_sources
    from cloud_server.training.moa import CHECKPOINT, Trainer
    from cloud_server.training.settings import TrainSettings

    summary_path = args.out / "ablation.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    texts = prompt_sources.training_prompts(("eval-framework", "sharegpt", "chitchat"))
    prompts = data.encode_prompts(target, texts[:args.prompts], 256)
    began = time.monotonic()
    data.generate_answers(target, prompts, args.out / "answers.jsonl", 32, args.max_new_tokens)
    samples = data.load_samples(args.out / "answers.jsonl")
    answered = time.monotonic()
    settings = TrainSettings(steps=args.steps, batch_tokens=args.batch_tokens,
                             draft_vocab=args.draft_vocab, checkpoint_every=10, seed=args.seed)
    trainer = Trainer(target.model, samples, settings, args.out, target.stop_token_ids(),
                      variants(target.model.config, args.draft_vocab, names))
    if (args.out / CHECKPOINT).exists():
        trainer.load_checkpoint()
    final = trainer.run()
    summary = {"samples": len(samples), "answer_tokens": sum(len(s.answer_ids) for s in samples),
               "answer_s": round(answered - began), "train_s": round(time.monotonic() - answered),
               "steps": args.steps, "batch_tokens": args.batch_tokens, "final": final}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def variant_dir(args: argparse.Namespace, name: str) -> Path:
    """Where a variant's weights are (`name` without its +suffix)."""
    base = name.split("+")[0]
    return args.out if base == MAIN else args.out / base


def design_trees(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Designs each Falcon variant's static tree (once); the names to evaluate, each Falcon
    variant followed by its +cddt."""
    from edge_client.drafters.static_trees import CHOICES_FILE

    from benchmarks.tree_design import design_tree

    evaluated = []
    for name in names:
        evaluated.append(name)
        if name.startswith("falcon"):
            if not (variant_dir(args, name) / CHOICES_FILE).exists():
                design_tree(variant_dir(args, name), args.max_nodes, args.calibration_prompts,
                            args.prompts, args.eval_new_tokens, args.weights)
            evaluated.append(f"{name}+cddt")
    return evaluated


def evaluate(args: argparse.Namespace, names: list[str], temperature: float) -> dict:
    """benchmarks/moa_tau.py over every variant (no lookup nodes)."""
    entries = ",".join(f"{n.split('+')[0]}={variant_dir(args, n)}"
                       + "".join(f"+{s}" for s in n.split("+")[1:]) for n in names)
    label = "greedy" if temperature == 0 else f"t{temperature:g}"
    return moa_tau.main(["--drafter", str(args.out), "--drafters", entries,
                         "--per-set", str(args.per_set), "--max-new-tokens",
                         str(args.eval_new_tokens), "--temperature", str(temperature),
                         "--weights", args.weights, "--max-nodes", str(args.max_nodes),
                         "--name", f"{args.name}_{label}"])["drafters"]


def report(args: argparse.Namespace, names: list[str], training: dict, greedy: dict,
           sampled: dict) -> None:
    """One table and one plot over the variants."""
    from cloud_server.moa.config import MoaConfig
    from cloud_server.moa.weights import CONFIG

    header = ("variant", "top-1 (train)", "tau greedy", f"tau T={args.temperature:g}",
              "edge step ms (1 / 8 queries)", "bundle MB (int8)", "wire bytes / token",
              "= plain greedy")
    rows = []
    for name in names:
        config = MoaConfig.load(variant_dir(args, name) / CONFIG)
        base = name.split("+")[0]
        top1 = training["final"].get("top1" if base == MAIN else f"{base}_top1")
        one, eight = greedy[name]["edge_step_ms"]
        rows.append((name, f"{top1:.3f}" if top1 is not None else "-",
                     f"{greedy[name]['mean_tau']:.2f}", f"{sampled[name]['mean_tau']:.2f}",
                     f"{one:.2f} / {eight:.2f}", f"{greedy[name]['bundle_mb']:.1f}",
                     2 * config.width if config.uses_activations else 0,
                     "{}/{}".format(*greedy[name]["lossless"])))
    text = (f"Drafter ablation: every variant trained on the same {training['steps']} batches of "
            f"{training['batch_tokens']} tokens ({training['samples']} prompts, "
            f"{training['answer_tokens']} answer tokens of the target's greedy answers; "
            f"training {training['train_s'] / 60:.0f} min for all together), measured in "
            f"process on {args.per_set} evaluation prompts per set, {args.eval_new_tokens} new "
            f"tokens, no lookup nodes, int8 edge graphs, target weights {args.weights}; "
            f"{machine()}\n\n"
            f"{markdown_table(header, rows)}\n")
    write_results(args.name, text)
    grouped_bars(RESULTS / f"{args.name}.png", ["greedy", f"T={args.temperature:g}"],
                 {n: [greedy[n]["mean_tau"], sampled[n]["mean_tau"]] for n in names},
                 "tau (tokens per round)", "Drafter ablation, same batches (drafter_ablation.py)",
                 baseline=1.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = args.names
    training = train(args, names)
    print(f"trained: {json.dumps(training['final'])}", file=sys.stderr, flush=True)
    names = design_trees(args, names)
    greedy = evaluate(args, names, 0.0)
    sampled = evaluate(args, names, args.temperature)
    report(args, names, training, greedy, sampled)


if __name__ == "__main__":
    main()
