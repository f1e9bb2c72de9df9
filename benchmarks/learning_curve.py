"""tau against training tokens: every snapshot of a train-drafter run, per student, in process.

A run made with `--snapshot-every N` holds the weights at steps N, 2N, ... under
snapshots/step-*/ and the final ones in the run directory itself. Each point is greedy split
decoding through the server's own session (benchmarks/moa_tau.py), without lookup nodes, on the
same evaluation prompts; the x axis is the answer tokens the students had seen in training (the
batch plan of the run, which is a function of its seed), so MoA and the Independent baseline
trained side by side are compared at equal data.

    python -m benchmarks.learning_curve --run runs/moa [--students main,independent] [--per-set 2]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.common import RESULTS, machine, markdown_table, write_results
from benchmarks.moa_tau import Entry, moa_contender, split_decode
from shared import prompt_sets as evaluation
from shared.drafter_bundle import Precision
from shared.messages import ChatMessage

MAIN = "main"  # the run's first student, written to the run directory itself


def points(run: Path) -> list[tuple[int, Path]]:
    """(step, weights directory) of every snapshot and the final weights, by step."""
    found = [(int(m.group(1)), d) for d in (run / "snapshots").glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", d.name))]
    final = json.loads((run / "training.json").read_text())["settings"]["steps"]
    return sorted(found) + [(final, run)]


def tokens_per_step(run: Path) -> float:
    """Answer tokens a step trains on, on average over the run's first epoch."""
    from cloud_server.training.batches import make_batches
    from cloud_server.training.data import load_samples

    settings = json.loads((run / "training.json").read_text())["settings"]
    samples = load_samples(run / "answers.jsonl")
    batches = make_batches(samples, settings["batch_tokens"], settings["max_len"],
                           settings["seed"], 0)
    return sum(len(s.answer_ids) for s in samples) / len(batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", type=Path, required=True, help="a train-drafter --out directory")
    p.add_argument("--students", default=f"{MAIN},independent",
                   help=f"comma-separated: {MAIN} (the first student) and subdirectory names")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--name", default="learning_curve", help="results file stem")
    args = p.parse_args()
    args.precision, args.max_depth, args.activations = Precision.INT8, 8, "fp16"
    run(args)


def run(args: argparse.Namespace) -> None:
    from cloud_server import model_store
    from cloud_server.target import TargetModel

    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    prompts = [target.apply_chat_template((ChatMessage("user", item["prompt"]),))
               for name in evaluation.SETS for item in evaluation.load(name, args.per_set)]
    per_step = tokens_per_step(args.run)
    students = args.students.split(",")
    curve: dict[str, list[tuple[float, float]]] = {s: [] for s in students}
    for step, directory in points(args.run):
        for student in students:
            where = directory if student == MAIN else directory / student
            contender = moa_contender(args, target, Entry(student, where, lookup=False,
                                                          graphs=False, race=False))
            rounds = []
            for prompt in prompts:
                log = split_decode(target, contender.server, contender.drafter, prompt,
                                   args.max_new_tokens, args.max_nodes)
                rounds += log.per_round
            curve[student].append((step * per_step, sum(rounds) / len(rounds)))
            print(f"step {step} {student}: tau {curve[student][-1][1]:.2f}", file=sys.stderr,
                  flush=True)
    report(args, curve)


def report(args: argparse.Namespace, curve: dict[str, list[tuple[float, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    students = list(curve)
    rows = [(f"{tokens / 1e3:.0f}k", *(f"{curve[s][i][1]:.2f}" for s in students))
            for i, (tokens, _) in enumerate(curve[students[0]])]
    text = (f"tau against answer tokens seen in training ({args.run}), greedy, in process, tree <= "
            f"{args.max_nodes} nodes, no lookup nodes, {args.max_new_tokens} new tokens, "
            f"{args.per_set} prompts per set ({', '.join(evaluation.SETS)}); {machine()}\n\n"
            f"{markdown_table(('answer tokens seen', *students), rows)}\n")
    write_results(args.name, text)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for student, points_ in curve.items():
        ax.plot([t / 1e3 for t, _ in points_], [tau for _, tau in points_], marker="o",
                label=student)
    ax.set_xlabel("answer tokens seen in training (thousands)")
    ax.set_ylabel("tau (tokens per round)")
    ax.set_title("MoA drafter: tau against training tokens (learning_curve.py)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
