"""Designs a trained drafter's static tree (Falcon's Custom-Designed Decoding Tree, designed from
measurement: edge_client/drafters/static_trees.py) and writes it into the drafter's directory,
where `moa_tau --drafters LABEL=DIR+cddt` reads it and `cloud-server` puts it in the drafter's
bundle (`edge-client --tree designed` drafts it).

The calibration decodes held-out prompts of the training sources (never an evaluation prompt,
never a prompt the drafters of `drafter_ablation` trained on: those are the first --skip)
split in process, and before every round walks the drafter down the target's own greedy text:
the rank of each token among its top-k, given the path above was right.

    python -m benchmarks.tree_design --drafter-dir runs/ablation/falcon-2 --max-nodes 64

The committed Falcon drafter trained on the first 12000 training-source prompts, so the design
committed beside it skips those:

    python -m benchmarks.tree_design --drafter-dir \
        cloud_server/moa/trained/SmolLM2-135M-Instruct/falcon --skip 12000
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import moa_tau
from edge_client.drafters import static_trees


def calibration_prompts(target, skip: int, count: int) -> list[list[int]]:
    from cloud_server.training import data, prompt_sources

    texts = prompt_sources.training_prompts(("eval-framework", "sharegpt", "chitchat"))
    return data.encode_prompts(target, texts[skip:skip + count], 256)


def design_tree(drafter_dir: Path, max_nodes: int, prompts: int, skip: int, max_new: int,
                weights: str) -> Path:
    """Calibrates the drafter in `drafter_dir`, designs its tree and writes it there."""
    from cloud_server.reference import plain_greedy

    args = moa_tau.parse_args(["--drafter", str(drafter_dir), "--drafters",
                               f"calibrated={drafter_dir}", "--max-nodes", str(max_nodes),
                               "--weights", weights])
    target = moa_tau.load_target(args)
    contender = moa_tau.moa_contender(args, target, moa_tau.Entry.parse(
        f"calibrated={drafter_dir}", drafter_dir))
    walks: list[list[int]] = []
    chosen = calibration_prompts(target, skip, prompts)  # those of at most 256 tokens
    for i, prompt in enumerate(chosen):
        answer = plain_greedy(target, prompt, max_new)
        walker = static_trees.RankWalker(contender.drafter, [*prompt, *answer])
        moa_tau.split_decode(target, contender.server, walker, prompt, max_new, max_nodes)
        walks += walker.walks
        print(f"calibration prompt {i + 1}/{len(chosen)}: {len(walks)} walks",
              file=sys.stderr, flush=True)
    hits = static_trees.rank_hits(walks, args.max_depth, contender.drafter.graphs.top_k)
    if not hits[0].any():
        raise RuntimeError(f"{drafter_dir}: in {len(walks)} walks the drafter never ranked the "
                           "target's next token among its top-k: no tree to design")
    choices = static_trees.design(hits, max_nodes)
    return static_trees.save(drafter_dir, choices, hits, len(walks))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter-dir", type=Path, required=True, help="a trained drafter")
    p.add_argument("--max-nodes", type=int, default=64, help="the tree's nodes")
    p.add_argument("--prompts", type=int, default=12, help="calibration prompts")
    p.add_argument("--skip", type=int, default=400,
                   help="training-source prompts to pass over (those the drafter trained on)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--weights", choices=("fp32", "q4"), default="q4")
    args = p.parse_args(argv)
    path = design_tree(args.drafter_dir, args.max_nodes, args.prompts, args.skip,
                       args.max_new_tokens, args.weights)
    print(path.read_text())


if __name__ == "__main__":
    main()
