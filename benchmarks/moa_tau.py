"""Offline tau of the drafters: split decoding in one process, no network.

For each drafter the target verifies its trees (at most --max-nodes nodes) through the server's
own session: greedy acceptance, or at --temperature T > 0 the session's default sampling rule;
for a MoA drafter the server half computes the fresh activations and the ONNX edge drafter takes
them, as docs/architecture.md, Pacing describes, all on one thread. Reports tau per set (tokens
per round, bonus included), acceptance by depth, drafting time per round, the edge's time per
step call against a plain target decode step, the bundle's size, and (greedy) whether the
output equals plain greedy.

Drafters (--drafters, comma-separated): pld, aded, recycle (Token Recycling, which only the
server can run: it drafts from the target's own top-k); moa (the --drafter directory); any
subdirectory of it that train-drafter wrote (independent, last, fused, kv); LABEL=DIR for
another trained drafter (a Falcon one, trained with --method falcon, drafts --block tokens per
step: edge_client/drafters/falcon.py); any trained entry with +lookup merges prompt-lookup nodes
into its trees, with +graphs merges repeated tokens into draft graphs (GSD), and with +race
ranks children by the session's race under --acceptance exponential-race (ERSD), and with +cddt
drafts the static tree designed for it (benchmarks/tree_design.py) instead of EAGLE-2's
dynamic tree; @int8 (or another precision) after it runs those graphs instead of --precision's,
so `moa@int8,moa@mixed` sets two precisions side by side.

    python -m benchmarks.moa_tau [--drafter DIR] [--drafters pld,moa,independent] [--per-set 6]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from shared import prompt_sets as evaluation
from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table, write_results
from shared.acceptance import AcceptanceMode
from benchmarks.step_timing import edge_step_ms, plain_step_ms, target_device
from shared.drafter_bundle import Graph, Precision
from shared.drafting.base import Drafter
from shared.drafting.race import RaceRanker
from shared.messages import ChatMessage, OpenRequest
from shared.sampling import SamplingParams


@dataclass
class RoundLog:
    tokens: list[int] = field(default_factory=list)  # new tokens, prompt excluded
    per_round: list[int] = field(default_factory=list)  # committed tokens per round
    draft_s: float = 0.0
    server_s: float = 0.0


class TimedServerHalf:
    """The server half, timed; what the session calls for activation rows."""

    def __init__(self, server, log: RoundLog) -> None:
        self.server, self.log = server, log
        self.hidden_layers = server.hidden_layers

    def __call__(self, cache, start: int, end: int, hidden=None) -> np.ndarray:
        began = time.perf_counter()
        rows = self.server(cache, start, end, hidden)
        self.log.server_s += time.perf_counter() - began
        return rows


def split_decode(target, server, drafter, prompt: list[int], max_new: int, max_nodes: int,
                 sampling: SamplingParams = SamplingParams(),
                 acceptance: AcceptanceMode | None = None) -> RoundLog:
    """Split decoding in process, through the server's own session and loop
    (cloud_server.decoding.server_decoding.decode_in_process); `server` (the server half) is None for
    a drafter that reads no activations. Times drafting and the server half apart."""
    from cloud_server.decoding.server_decoding import decode_in_process

    log = RoundLog()
    request = OpenRequest(prompt_ids=tuple(prompt), max_new_tokens=max_new, sampling=sampling,
                          acceptance=acceptance)
    run = decode_in_process(target, request, drafter, max_nodes,
                            TimedServerHalf(server, log) if server else None)
    log.tokens = [t for v in run.verdicts for t in v.tokens]
    log.per_round = [len(v.tokens) for v in run.verdicts[1:]]
    log.draft_s = run.draft_s
    return log


TRAINING_FREE = ("pld", "aded", "recycle")  # recycle: Token Recycling, the server's own
LOOKUP = "+lookup"
GRAPHS = "+graphs"
RACE = "+race"  # under exponential-race: rank children by the fitted race ranker
CDDT = "+cddt"  # the static tree designed for the drafter (benchmarks/tree_design.py)
SUFFIXES = {LOOKUP[1:], GRAPHS[1:], RACE[1:], CDDT[1:]}


@dataclass(frozen=True)
class Entry:
    """One trained drafter of --drafters: LABEL=DIR or a name, then any of +lookup, +graphs,
    +race and +cddt, then @PRECISION."""

    name: str  # the label in the tables, with its suffixes
    directory: Path
    lookup: bool
    graphs: bool
    race: bool
    cddt: bool = False
    precision: Precision | None = None  # None: --precision

    @classmethod
    def parse(cls, text: str, drafter: Path) -> "Entry":
        head, _, precision = text.partition("@")
        entry = cls._parse(head, drafter)
        if not precision:
            return entry
        try:
            return replace(entry, name=text, precision=Precision(precision))
        except ValueError:
            raise ValueError(f"{text}: the precisions are "
                             f"{', '.join(p.value for p in Precision)}") from None

    @classmethod
    def _parse(cls, text: str, drafter: Path) -> "Entry":
        base, *suffixes = text.split("+")
        label, _, path = base.partition("=")
        directory = Path(path) if path else drafter if label == "moa" else drafter / label
        if set(suffixes) - SUFFIXES:
            raise ValueError(f"{text}: the suffixes are {', '.join(sorted(SUFFIXES))}")
        return cls("+".join((label, *suffixes)), directory, LOOKUP[1:] in suffixes,
                   GRAPHS[1:] in suffixes, RACE[1:] in suffixes, CDDT[1:] in suffixes)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark for a command line (sys.argv's by default); returns its results."""
    return run(parse_args(argv))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from cloud_server.moa.weights import TRAINED, WEIGHTS
    from edge_client.drafters.tree_search import TreeSearch

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafter", type=Path, default=TRAINED / "SmolLM2-135M-Instruct",
                   help="trained MoA drafter directory (its subdirectories name more)")
    p.add_argument("--drafters", default="pld,aded,moa,moa+lookup",
                   help="comma-separated: pld, aded, moa, a subdirectory of --drafter "
                        "(independent, last, fused, kv), LABEL=DIR; +lookup after a MoA entry "
                        "adds prompt-lookup nodes")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy acceptance; above: the default sampling rule, seeded")
    p.add_argument("--acceptance", type=AcceptanceMode, choices=list(AcceptanceMode),
                   metavar="|".join(m.value for m in AcceptanceMode),
                   default=None, help="with --temperature: the rule (default: the session's)")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=TreeSearch.max_depth)
    p.add_argument("--beam", type=int, default=TreeSearch.beam,
                   help="nodes of a depth the dynamic tree expands")
    p.add_argument("--lookup-nodes", type=int, default=16,
                   help="prompt-lookup nodes merged into moa+lookup trees")
    p.add_argument("--precision", type=Precision, choices=list(Precision), default=Precision.MIXED,
                   help="the edge graphs' weights")
    p.add_argument("--activations", choices=("fp16", "int8"), default="fp16",
                   help="the activations' wire encoding, applied as a round trip")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the target runs (the edge drafter always runs on the CPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the target's precision")
    p.add_argument("--weights", choices=("fp32", "q4"), default="fp32",
                   help="the target's weights (cloud-server --weights): q4 runs the GGUF's "
                        "4-bit blocks, whose activations the drafter then reads")
    p.add_argument("--name", default="moa_tau", help="results file stem")
    args = p.parse_args(argv)
    for entry in args.drafters.split(","):
        if entry in TRAINING_FREE:
            continue
        try:
            directory = Entry.parse(entry, args.drafter).directory
        except ValueError as err:
            p.error(f"--drafters {err}")
        if not (directory / WEIGHTS).is_file():
            p.error(f"--drafters {entry}: no trained drafter in {directory} (train one with "
                    "`cloud-server train-drafter`, or leave it out)")
    return args


@dataclass
class Contender:
    """A drafter under test, with the server half that feeds it (None: it reads none)."""
    name: str
    drafter: Drafter
    server: Callable[..., np.ndarray] | None
    bundle: Path | None = None
    precision: Precision | None = None  # of the graphs the edge runs
    bundle_mb: float = 0.0  # those graphs' files
    step_calls: Callable[[], int] | None = None  # a trained drafter's step graph runs so far
    ranker: Callable[[], RaceRanker | None] | None = None  # a +race drafter's fit so far
    rounds: dict[str, list[int]] = field(default_factory=dict)  # set -> committed per round
    draft_s: float = 0.0
    server_s: float = 0.0
    lossless: int = 0
    runs: int = 0


def contenders(args: argparse.Namespace, target) -> list[Contender]:
    """Builds each drafter asked for; the MoA bundles are exported once and cached."""
    from cloud_server.decoding.server_decoding import own_drafter
    from shared.messages import Limits

    built = []
    for entry in args.drafters.split(","):
        if entry in TRAINING_FREE:
            drafter = own_drafter(entry, Limits(max_tree_depth=args.max_depth))
            built.append(Contender(entry, drafter, None))
            continue
        parsed = Entry.parse(entry, args.drafter)
        built.append(moa_contender(args, target, parsed))
    return built


def moa_contender(args: argparse.Namespace, target, entry: Entry) -> Contender:
    """A trained drafter (its bundle exported once and cached) with its server half; `args`
    gives precision, max_depth and activations."""
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.moa.config import MoaConfig
    from cloud_server.moa.weights import CONFIG
    from edge_client.drafters import static_trees
    from edge_client.drafters.lookup_merge import LookupMerge
    from edge_client.drafters.moa_bundle import load_manifest
    from edge_client.drafters.moa_graphs import MoaGraphs
    from edge_client.drafters.race_aware import RaceAware
    from edge_client.drafters.trained import TREE_DRAFTERS
    from edge_client.drafters.tree_search import TreeSearch
    from shared.cache import cache_root

    server = None
    if MoaConfig.load(entry.directory / CONFIG).uses_activations:
        server = ServerActivations.load(entry.directory, target.model)
        if args.activations == "int8":
            server = Int8RoundTrip(server)
    bundle = build_bundle(entry.directory, target.model, target.model_id,
                          cache_root() / "moa-bundles")
    manifest = load_manifest(bundle)
    precision = entry.precision or args.precision
    size = sum((bundle / manifest.graph(precision, g)).stat().st_size for g in Graph)
    graphs = MoaGraphs(bundle, precision)
    tree = TREE_DRAFTERS[graphs.kind](graphs, TreeSearch(
        args.max_depth, args.beam, merge=entry.graphs,
        choices=static_trees.load(entry.directory) if entry.cddt else None))
    race = RaceAware(tree, graphs.vocab) if entry.race else None
    ranked = tree if race is None else race
    drafter = LookupMerge(ranked, args.lookup_nodes, entry.graphs) if entry.lookup else ranked
    return Contender(entry.name, drafter, server, bundle, precision, size / 1e6,
                     lambda: graphs.step_calls, (lambda: race.ranker) if race else None)


def load_target(args: argparse.Namespace):
    """The default target as `args` ask (device, dtype, weights)."""
    from cloud_server import model_store
    from cloud_server.target import TargetModel

    gguf = model_store.gguf_of(model_store.DEFAULT_SPEC) if args.weights == "q4" else None
    return TargetModel.load(*model_store.resolve("default"), args.device,
                            precision=args.dtype, weights=args.weights, gguf=gguf)


def run(args: argparse.Namespace) -> dict:
    from cloud_server.reference import compare, plain_greedy

    target = load_target(args)
    tested = contenders(args, target)
    greedy = args.temperature == 0
    for name in evaluation.SETS:
        for index, item in enumerate(evaluation.load(name, args.per_set)):
            prompt = target.apply_chat_template((ChatMessage("user", item["prompt"]),))
            plain = plain_greedy(target, prompt, args.max_new_tokens) if greedy else []
            sampling = SamplingParams(temperature=args.temperature, seed=index)
            for c in tested:
                log = split_decode(target, c.server, c.drafter, prompt, args.max_new_tokens,
                                   args.max_nodes, sampling, args.acceptance)
                same = greedy and compare(target, prompt, log.tokens[:args.max_new_tokens],
                                          plain).lossless
                c.rounds.setdefault(name, []).extend(log.per_round)
                c.draft_s += log.draft_s
                c.server_s += log.server_s
                c.lossless += same
                c.runs += 1
                print(f"{item['id']} {c.name}: tau {sum(log.per_round) / len(log.per_round):.2f}"
                      f", lossless {same}", file=sys.stderr, flush=True)
    return report(args, target, tested)


def _tau(rounds: list[int]) -> float:
    return sum(rounds) / len(rounds)


def _accepted_by_depth(rounds: list[int], depth: int) -> list[float]:
    """P(at least d drafts accepted) for d = 1..depth: a round commits accepted drafts + 1."""
    return [sum(n - 1 >= d for n in rounds) / len(rounds) for d in range(1, depth + 1)]


def _race_fits(tested: list[Contender]) -> str:
    """A line per race-aware drafter: the weights its ranker ended with (race.py)."""
    lines = []
    for c in tested:
        ranker = c.ranker() if c.ranker else None
        if ranker is not None:
            a, b = ranker.weights
            lines.append(f"{c.name}: P(race picks x) = softmax({a:.2f} log q + {b:.2f} G), fitted "
                         f"on {ranker.fitted} committed positions\n\n")
    return "".join(lines)


def report(args: argparse.Namespace, target, tested: list[Contender]) -> dict:
    plain_ms = plain_step_ms(target)
    header = ("drafter", *evaluation.SETS, "mean tau", "draft ms/round", "draft ms/token",
              "edge steps/round",
              "server half ms/round", "edge step ms (1/8 queries)", "bundle MB",
              "= plain greedy")
    rows, depth_rows, results = [], [], {}
    for c in tested:
        every = [n for rounds in c.rounds.values() for n in rounds]
        steps = ((edge_step_ms(c.bundle, c.precision, 1),
                  edge_step_ms(c.bundle, c.precision, 8)) if c.bundle and c.precision else None)
        rows.append((c.name, *(f"{_tau(c.rounds[s]):.2f}" for s in evaluation.SETS),
                     f"{_tau(every):.2f}", f"{1000 * c.draft_s / len(every):.1f}",
                     f"{1000 * c.draft_s / sum(every):.2f}",
                     f"{c.step_calls() / len(every):.1f}" if c.step_calls else "-",
                     f"{1000 * c.server_s / len(every):.1f}" if c.server else "-",
                     f"{steps[0]:.2f} / {steps[1]:.2f}" if steps else "-",
                     f"{c.bundle_mb:.1f}" if c.bundle else "-",
                     f"{c.lossless}/{c.runs}" if args.temperature == 0 else "-"))
        accepted = _accepted_by_depth(every, args.max_depth)
        depth_rows.append((c.name, *(f"{a:.2f}" for a in accepted)))
        results[c.name] = {"tau": {s: _tau(c.rounds[s]) for s in evaluation.SETS},
                           "mean_tau": _tau(every), "accepted_by_depth": accepted,
                           "edge_step_ms": steps, "bundle_mb": c.bundle_mb,
                           "draft_ms": 1000 * c.draft_s / len(every),
                           "draft_ms_per_token": 1000 * c.draft_s / sum(every),
                           "edge_steps": c.step_calls() / len(every) if c.step_calls else None,
                           "lossless": [c.lossless, c.runs]}
    depth_header = ("drafter", *(f"d={d}" for d in range(1, args.max_depth + 1)))
    how = "greedy" if args.temperature == 0 else (
        f"temperature {args.temperature}, acceptance "
        f"{args.acceptance.value if args.acceptance else 'the default'}")
    text = (f"Drafters in process, {how}, tree <= {args.max_nodes} nodes, depth <= "
            f"{args.max_depth}, beam {args.beam}, {args.max_new_tokens} new tokens, {args.per_set} prompts per "
            f"set; MoA drafter {args.drafter.name} ({args.precision} graphs, {args.activations} "
            f"activations); moa+lookup merges up to {args.lookup_nodes} prompt-lookup nodes; "
            f"target on {target_device(target)} in {args.dtype}, --weights {args.weights}; "
            f"{machine()}\n\n"
            f"tau (tokens per round, bonus included):\n\n"
            f"{markdown_table(header, rows)}\n\nP(at least d drafts accepted in a round):\n\n"
            f"{markdown_table(depth_header, depth_rows)}\n\n{_race_fits(tested)}plain target "
            f"decode step {plain_ms:.1f} ms\n")
    write_results(args.name, text)
    summary = {"drafters": results, "plain_step_ms": plain_ms}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    series = {c.name: [_tau(c.rounds[s]) for s in evaluation.SETS]
              + [_tau([n for rounds in c.rounds.values() for n in rounds])] for c in tested}
    grouped_bars(RESULTS / f"{args.name}.png", [*evaluation.SETS, "all"], series,
                 "tau (tokens per round)",
                 f"Drafters in process, {how}, tree <= {args.max_nodes} nodes (moa_tau.py)",
                 baseline=1.0)
    return summary


class Int8RoundTrip:
    """The server half's rows through the int8 wire encoding and back."""

    def __init__(self, server) -> None:
        self.server, self.hidden_layers = server, server.hidden_layers

    def __call__(self, cache, start: int, end: int, hidden=None) -> np.ndarray:
        from shared.activation_codec import from_int8, to_int8

        return from_int8(*to_int8(self.server(cache, start, end, hidden)))


if __name__ == "__main__":
    main()
