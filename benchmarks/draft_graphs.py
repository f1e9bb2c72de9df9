"""Draft graphs (GSD) against plain trees: the same MoA drafter with and without merging.

With merging, nodes of one depth that repeat a token are drafted once and their subtree is
repeated under each (edge_client/drafters/moa.py, shared/draft_graph.py); the wire sends each
repeated subtree once. Both run in process through the server's own session (moa_tau.py's
loop), greedy, trees of at most --max-nodes nodes, on the evaluation prompts, back to back on
each prompt. Reports tau, drafting time and step-graph rows per round, nodes and bytes per draft
on the wire (the Draft message as sent, and the same tree sent plain), and whether every output
equals plain greedy.

    python -m benchmarks.draft_graphs [--per-set 6] [--lookup-nodes 16]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from benchmarks.moa_tau import Entry, moa_contender, split_decode
from shared import prompt_sets as evaluation
from shared import wire
from shared.drafter_bundle import Precision
from shared.draft_graph import fold
from shared.messages import ChatMessage, DraftRequest
from shared.tree import DraftTree


@dataclass
class Tally:
    """One variant's totals over every prompt."""
    name: str
    rounds: list[int] = field(default_factory=list)  # committed tokens per round
    draft_s: float = 0.0
    rows: int = 0  # step-graph query rows run
    nodes: int = 0  # unrolled nodes verified
    sent: int = 0  # nodes on the wire
    bytes_graph: int = 0
    bytes_plain: int = 0
    drafts: int = 0
    lossless: int = 0
    runs: int = 0


class Recorder:
    """Wraps a MoA drafter: keeps the trees it proposes and counts the step rows its graphs
    run."""

    def __init__(self, drafter, graphs) -> None:
        self.drafter, self.trees, self.rows = drafter, [], 0
        step = graphs.step

        def counted(ids, *args, **kwargs):
            self.rows += len(ids)
            return step(ids, *args, **kwargs)

        graphs.step = counted

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        tree = self.drafter.propose(context, max_nodes)
        self.trees.append(tree)
        return tree


def main() -> None:
    from cloud_server.moa.weights import TRAINED

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafter", type=Path, default=TRAINED / "SmolLM2-135M-Instruct")
    p.add_argument("--per-set", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--lookup-nodes", type=int, default=16)
    p.add_argument("--name", default="draft_graphs", help="results file stem")
    args = p.parse_args()
    args.precision, args.activations = Precision.INT8, "fp16"
    report(args, measure(args))


def recorded(bundle: Path, args: argparse.Namespace, merge: bool) -> Recorder:
    """The MoA drafter with prompt-lookup nodes, drafting trees or (`merge`) draft graphs."""
    from edge_client.drafters.lookup_merge import LookupMerge
    from edge_client.drafters.moa import MoaDrafter
    from edge_client.drafters.moa_graphs import MoaGraphs
    from edge_client.drafters.tree_search import TreeSearch

    graphs = MoaGraphs(bundle, args.precision)
    drafter = MoaDrafter(graphs, TreeSearch(args.max_depth, merge=merge))
    return Recorder(LookupMerge(drafter, args.lookup_nodes, merge), graphs)


def measure(args: argparse.Namespace) -> list[Tally]:
    from cloud_server import model_store
    from cloud_server.reference import compare, plain_greedy
    from cloud_server.target import TargetModel

    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    base = moa_contender(args, target, Entry("moa", args.drafter, lookup=True, graphs=False,
                                             race=False))
    variants = {name: recorded(base.bundle, args, merge)
                for name, merge in (("tree", False), ("graph (merged)", True))}
    tallies = [Tally(name) for name in variants]
    for set_name in evaluation.SETS:
        for item in evaluation.load(set_name, args.per_set):
            prompt = target.apply_chat_template((ChatMessage("user", item["prompt"]),))
            plain = plain_greedy(target, prompt, args.max_new_tokens)
            for tally, recorder in zip(tallies, variants.values()):
                log = split_decode(target, base.server, recorder, prompt, args.max_new_tokens,
                                   args.max_nodes)
                tally.rounds += log.per_round
                tally.draft_s += log.draft_s
                tally.runs += 1
                tally.lossless += compare(target, prompt, log.tokens[:args.max_new_tokens],
                                          plain).lossless
                print(f"{item['id']} {tally.name}: tau "
                      f"{sum(log.per_round) / len(log.per_round):.2f}", file=sys.stderr,
                      flush=True)
    for tally, recorder in zip(tallies, variants.values()):
        tally.rows = recorder.rows
        count_wire(tally, recorder.trees)
    return tallies


def count_wire(tally: Tally, trees: list[DraftTree]) -> None:
    """Nodes and bytes of each tree's Draft message, as sent and as a plain tree."""
    for tree in trees:
        draft = DraftRequest(1, 1000, tree)
        tally.drafts += 1
        tally.nodes += len(tree)
        tally.sent += len(fold(tree).tree)
        tally.bytes_graph += wire.draft_to_proto(draft, graphs=True).ByteSize()
        tally.bytes_plain += wire.draft_to_proto(draft, graphs=False).ByteSize()


def report(args: argparse.Namespace, tallies: list[Tally]) -> None:
    header = ("variant", "tau", "draft ms/round", "step rows/round", "nodes verified/draft",
              "nodes sent/draft", "bytes sent/draft", "bytes as a plain tree", "= plain greedy")
    rows, results = [], {}
    for t in tallies:
        per_round = len(t.rounds)
        figures = {"tau": sum(t.rounds) / per_round, "draft_ms": 1000 * t.draft_s / per_round,
                   "rows": t.rows / per_round, "nodes": t.nodes / t.drafts,
                   "sent": t.sent / t.drafts, "bytes": t.bytes_graph / t.drafts,
                   "bytes_plain": t.bytes_plain / t.drafts}
        results[t.name] = {**figures, "lossless": [t.lossless, t.runs]}
        rows.append((t.name, f"{figures['tau']:.2f}", f"{figures['draft_ms']:.1f}",
                     f"{figures['rows']:.1f}", f"{figures['nodes']:.1f}",
                     f"{figures['sent']:.1f}", f"{figures['bytes']:.0f}",
                     f"{figures['bytes_plain']:.0f}", f"{t.lossless}/{t.runs}"))
    text = (f"MoA drafter {args.drafter.name} with {args.lookup_nodes} lookup nodes, in process, "
            f"greedy, trees <= {args.max_nodes} nodes, depth <= {args.max_depth}, "
            f"{args.max_new_tokens} new tokens, {args.per_set} prompts per set "
            f"({len(evaluation.SETS)} sets); {machine()}\n\n{markdown_table(header, rows)}\n")
    write_results(args.name, text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    first = results[tallies[0].name]
    metrics = ("tau", "draft_ms", "rows", "sent", "bytes")
    grouped_bars(RESULTS / f"{args.name}.png",
                 ["tau", "draft ms/round", "step rows/round", "nodes sent", "bytes sent"],
                 {name: [r[m] / first[m] for m in metrics] for name, r in results.items()},
                 f"relative to {tallies[0].name}",
                 "Draft graphs (GSD) against plain trees (draft_graphs.py)", baseline=1.0)


if __name__ == "__main__":
    main()
