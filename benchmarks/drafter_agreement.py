"""How often a trained drafter's top-1 (and top-8) hold the target's next token, per distance
from the last verified position: the depth of a draft.

The target answers evaluation prompts greedily (never trained on); each answer then runs through
every drafter with the verified boundary held at distance d from every position, exactly as
the drafter computes a draft d tokens past its last activation (cloud_server/training/unroll.py:
a recurrent drafter reads its own outputs there). A drafter that uses the
target's states should be best at d = 1 and decay with d; one that does not is flat.

    python -m benchmarks.drafter_agreement --drafters last=DIR,recurrent=DIR2 [--per-set 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import RESULTS, machine, markdown_table, write_results
from shared import prompt_sets as evaluation
from shared.messages import ChatMessage

TOP_K = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafters", required=True, type=named_dirs,
                   help="comma-separated NAME=DIR, each a train-drafter output directory")
    p.add_argument("--per-set", type=int, default=3, help="evaluation prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--distances", type=int, default=8)
    p.add_argument("--name", default="drafter_agreement", help="results file stem")
    args = p.parse_args()
    report(args, measure(args))


def named_dirs(text: str) -> dict[str, Path]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if not pairs or any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=DIR[,NAME=DIR...]")
    return {name: Path(directory) for name, directory in pairs}


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """drafter name -> (top-1, top-k) agreement at distances 1..args.distances."""
    from cloud_server import model_store
    from cloud_server.target import TargetModel
    from cloud_server.training.data import Sample, answer_batch

    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    prompts = [target.apply_chat_template((ChatMessage("user", item["prompt"]),))
               for name in evaluation.SETS for item in evaluation.load(name, args.per_set)]
    answers = answer_batch(target, prompts, args.max_new_tokens)
    samples = [Sample(tuple(p), tuple(a)) for p, a in zip(prompts, answers)]
    print(f"{len(samples)} answers, {sum(map(len, answers))} tokens", file=sys.stderr)
    return {name: agreement(target, directory, samples, args.distances)
            for name, directory in args.drafters.items()}


def agreement(target, directory: Path, samples: list, distances: int
              ) -> list[tuple[float, float]]:
    from cloud_server.moa.weights import load_drafter
    from cloud_server.training.batches import collate
    from cloud_server.training.moa import Student, teacher
    from cloud_server.training.unroll import unrolled

    config, server, edge = load_drafter(directory, target.model)
    student = Student("", config, server, edge)
    counts = torch.zeros(distances, 3)  # top-1 hits, top-k hits, positions
    for sample in samples:
        batch = collate([sample], pad=0, max_len=10**6, device=target.device)
        taught = teacher(target.model, batch, [config])
        memory = student.memory(batch.ids, taught)
        wanted = edge.logits(taught.target_hidden[0]).argmax(-1)  # [T]: in the draft head
        positions = torch.arange(batch.ids.shape[1])
        prompt_len = batch.prompt_lens[0]
        depths = unrolled(edge, server, batch.ids, memory, passes=distances)
        for d, hidden in enumerate(depths, start=1):
            top = edge.logits(hidden[0]).topk(TOP_K, -1).indices  # [T, k]
            real = batch.select[0] & (positions - d >= prompt_len - 1)  # [T]: truly at d
            counts[d - 1] += torch.tensor([float((top[:, 0] == wanted)[real].sum()),
                                           float((top == wanted[:, None]).any(-1)[real].sum()),
                                           float(real.sum())])
    print(f"{directory}: top-1 {counts[:, 0].div(counts[:, 2]).tolist()}", file=sys.stderr)
    return [(float(h1 / n), float(hk / n)) for h1, hk, n in counts.tolist()]


def report(args: argparse.Namespace, results: dict[str, list[tuple[float, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header = ("drafter", *(f"d={d}" for d in range(1, args.distances + 1)))
    rows = [(f"{name} top-1 / top-{TOP_K}",
             *(f"{top1:.2f} / {topk:.2f}" for top1, topk in values))
            for name, values in results.items()]
    text = (f"Agreement with the target's greedy next token at distance d from the last "
            f"verified position, on the target's own answers to {args.per_set} prompts per "
            f"evaluation set ({', '.join(evaluation.SETS)}), {args.max_new_tokens} new tokens "
            f"(benchmarks/drafter_agreement.py); {machine()}\n\n"
            f"{markdown_table(header, rows)}\n")
    write_results(args.name, text)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = range(1, args.distances + 1)
    for name, values in results.items():
        line, = ax.plot(steps, [top1 for top1, _ in values], marker="o", label=f"{name} top-1")
        ax.plot(steps, [topk for _, topk in values], linestyle="--", color=line.get_color(),
                label=f"{name} top-{TOP_K}")
    ax.set_xlabel("distance from the last verified position (draft depth)")
    ax.set_ylabel("agreement with the target")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Drafter agreement per draft depth (drafter_agreement.py)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
