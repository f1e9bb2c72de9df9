"""Offline text: what each drafter the edge could run alone writes while the link is down.

For each evaluation prompt and cut k (--cuts), split decoding runs in process through the
server's own session (moa_tau's loop) until k tokens are committed, so the drafter holds what
a real session gives it at that moment (the activations of the verified positions, the
training-free drafters' tables). The link then drops: the edge writes --offline tokens alone,
exactly as edge_client/offline.py does (the best path of a small tree, step after step, with
no 4-gram of the offline text repeated). One target forward over the whole text then scores
them, as the server's reconciliation would:
- kept: the offline tokens before the first that differs from the target's own greedy text;
- top-1, top-5: the share of offline tokens that are among the target's first 1 or 5 given the
  offline text before them, and the top-1 share by offline position (the plot);
- repeated 4-grams: the share of the offline tokens' 4-grams seen earlier in them, beside the
  same for the target's own continuation of equal length.

    python -m benchmarks.offline_text [--per-set 2] [--cuts 16,48] [--offline 64]
        [--drafters "pld>moa+lookup,moa+lookup,independent,falcon=DIR,aded,pld"]

pld> before a drafter: offline, prompt lookup's path first where it has one, else the
drafter's (the drafter drafts online alone), as the edge does (edge_client/generation_drafts.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, machine, markdown_table, write_results
from shared import prompt_sets as evaluation
from shared.messages import ChatMessage

FALCON = "falcon=cloud_server/moa/trained/SmolLM2-135M-Instruct/falcon"
FIRST = "pld>"  # before a drafter: offline, prompt lookup's path first where it has one
TOP = 5
SMOOTH = 8  # positions per window of the plot


@dataclass
class Scores:
    """One generator's offline tokens, over every prompt and cut."""
    kept: list[int] = field(default_factory=list)
    top1: list[np.ndarray] = field(default_factory=list)  # per run: [offline] bool
    top5: list[np.ndarray] = field(default_factory=list)
    repeats: list[float] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    per_prompt: list[dict] = field(default_factory=list)


def repeated_4grams(tokens: list[int]) -> float:
    """The share of the 4-grams of `tokens` that occurred earlier in them."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


def target_top(target, text: list[int], start: int) -> np.ndarray:
    """[len(text) - start, TOP]: the target's first TOP ids for each of text[start:], given the
    text before it (one forward)."""
    import torch

    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([text], device=target.device)).logits[0]
    return logits[start - 1:len(text) - 1].topk(TOP, dim=-1).indices.cpu().numpy()


def offline_run(target, contender, prompt: list[int], cut: int, room: int,
                reference: list[int], max_nodes: int, lookup_first: bool) -> dict:
    """Split decoding to `cut` tokens, then `room` offline tokens, scored. `lookup_first`:
    offline, prompt lookup's path where it has one, else the drafter's."""
    from benchmarks.moa_tau import split_decode
    from edge_client.offline import draft_offline
    from shared.drafting.pld import PromptLookupDrafter

    log = split_decode(target, contender.server, contender.drafter, prompt, cut, max_nodes)
    committed = log.tokens[:cut]
    context = [*prompt, *log.tokens]
    drafters = (PromptLookupDrafter(), contender.drafter) if lookup_first else (
        contender.drafter,)
    offline = draft_offline(drafters, context, room)
    top = target_top(target, [*context, *offline], len(context)) if offline else np.zeros(
        (0, TOP), np.int64)
    ids = np.asarray(offline, dtype=np.int64)
    own = reference[len(log.tokens):len(log.tokens) + len(offline)]
    kept = next((i for i, (a, b) in enumerate(zip(offline, own)) if a != b), len(offline))
    assert committed == reference[:len(committed)]  # greedy split decoding is lossless
    return {"kept": kept, "top1": top[:, 0] == ids, "top5": (top == ids[:, None]).any(axis=1),
            "repeats": repeated_4grams(offline), "written": len(offline)}


def run(args: argparse.Namespace) -> dict:
    from benchmarks import moa_tau
    from cloud_server.reference import plain_greedy

    entries = args.drafters.split(",")
    tau_args = moa_tau.parse_args(["--drafters", ",".join(e.removeprefix(FIRST)
                                                          for e in entries),
                                   "--max-nodes", str(args.max_nodes)])
    target = moa_tau.load_target(tau_args)
    tested = moa_tau.contenders(tau_args, target)
    for entry, contender in zip(entries, tested):
        contender.name = entry.partition("=")[0]
    scores = {c.name: Scores() for c in tested}
    own_repeats: list[float] = []
    for name in evaluation.SETS:
        for item in evaluation.load(name, args.per_set):
            prompt = target.apply_chat_template((ChatMessage("user", item["prompt"]),))
            for cut in args.cuts:
                # the target's own text, with room for a last round that committed more
                reference = plain_greedy(target, prompt, cut + args.offline + 16)
                own_repeats.append(repeated_4grams(reference[cut:cut + args.offline]))
                for c in tested:
                    result = offline_run(target, c, prompt, cut, args.offline, reference,
                                         args.max_nodes, c.name.startswith(FIRST))
                    s = scores[c.name]
                    for key in ("kept", "top1", "top5", "repeats", "written"):
                        getattr(s, key).append(result[key])
                    shares = {k: float(np.mean(result[k])) if result["written"] else None
                              for k in ("top1", "top5")}
                    s.per_prompt.append({"prompt": item["id"], "cut": cut,
                                         "written": result["written"], "kept": result["kept"],
                                         **shares, "repeats": result["repeats"]})
                    print(f"{item['id']} k={cut} {c.name}: {result['written']} written, kept "
                          f"{result['kept']}, top-1 {shares['top1']}", file=sys.stderr,
                          flush=True)
    return report(args, scores, float(np.mean(own_repeats)))


def report(args: argparse.Namespace, scores: dict[str, Scores], own_repeats: float) -> dict:
    header = ("generator", "offline tokens", "kept", "top-1", "top-5", "repeated 4-grams")
    rows, summary = [], {}
    for name, s in scores.items():
        top1, top5 = np.concatenate(s.top1), np.concatenate(s.top5)
        summary[name] = {"by_position": by_position(s.top1, args.offline).tolist(),
                         "kept": float(np.mean(s.kept)), "top1": float(top1.mean()),
                         "top5": float(top5.mean()), "repeats": float(np.mean(s.repeats)),
                         "written": float(np.mean(s.written)), "per_prompt": s.per_prompt}
        rows.append((name, f"{np.mean(s.written):.1f}", f"{np.mean(s.kept):.1f}",
                     f"{top1.mean():.2f}", f"{top5.mean():.2f}", f"{np.mean(s.repeats):.2f}"))
    rows.append(("the target's own continuation", str(args.offline), "-", "1.00", "1.00",
                 f"{own_repeats:.2f}"))
    text = (f"Offline text: split decoding in process to k in {args.cuts} committed tokens, "
            f"then {args.offline} offline tokens (edge_client/offline.py), scored by the "
            f"target; {args.per_set} prompts per set, greedy, trees <= {args.max_nodes} "
            f"nodes online; means over prompts and cuts (kept, repeats) or over every "
            f"offline token (top-1, top-5); {machine()}\n\n{markdown_table(header, rows)}\n")
    write_results(args.name, text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"generators": summary, "own_repeats": own_repeats}, indent=1))
    plot(RESULTS / f"{args.name}.png", scores, args.offline)
    return summary


def by_position(runs: list[np.ndarray], room: int) -> np.ndarray:
    """[room]: the share of runs whose token at each offline position is the target's top-1,
    over the runs that wrote that far, in windows of SMOOTH positions (nan: none did)."""
    hits, written = np.zeros(room), np.zeros(room)
    for run in runs:
        hits[:len(run)] += run
        written[:len(run)] += 1
    window = np.ones(SMOOTH)
    with np.errstate(invalid="ignore"):
        return np.convolve(hits, window, "same") / np.convolve(written, window, "same")


def plot(path: Path, scores: dict[str, Scores], room: int) -> None:
    """Top-1 agreement by offline position, one line per generator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, s in scores.items():
        ax.plot(np.arange(1, room + 1), by_position(s.top1, room), label=name)
    ax.set_xlabel("offline position")
    ax.set_ylabel("share that is the target's top-1")
    ax.set_ylim(0, 1)
    ax.set_title(f"Offline text: agreement with the target by position ({SMOOTH}-position "
                 "windows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafters", default=f"{FIRST}moa+lookup,moa+lookup,{FIRST}independent,"
                                         f"independent,{FALCON},aded,pld",
                   help="as benchmarks.moa_tau's --drafters")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--cuts", type=lambda t: [int(x) for x in t.split(",")], default=[16, 48])
    p.add_argument("--offline", type=int, default=64)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--name", default="offline_text", help="results file stem")
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
