"""Offline tau of the MoA drafter: split greedy decoding in one process, no network (issue 3).

The target verifies each MoA tree (at most --max-nodes nodes) with greedy acceptance, the server
half computes the fresh activations from the compacted cache, and the ONNX edge drafter takes
them, as DESIGN section 1 describes, all on one thread. Reports tau (tokens per round, bonus
included), acceptance by depth, draft / verify / server-half time per round, the edge's time
per step call against a plain target decode step, and whether the output equals plain greedy.

    python -m benchmarks.moa_tau --drafter DIR [--per-set 2] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from benchmarks import prompts as evaluation
from benchmarks.common import RESULTS, grouped_bars, machine, markdown_table
from shared.acceptance import accept_greedy
from shared.messages import ChatMessage


@dataclass
class RoundLog:
    tokens: list[int] = field(default_factory=list)  # new tokens, prompt excluded
    per_round: list[int] = field(default_factory=list)  # committed tokens per round
    draft_s: float = 0.0
    verify_s: float = 0.0
    server_s: float = 0.0


def split_greedy(target, server, drafter, prompt: list[int], max_new: int,
                 max_nodes: int) -> RoundLog:
    """Split greedy decoding in-process: the MoA loop of DESIGN section 1 without the wire.
    `server` (the server half) is None for a drafter that reads no activations."""
    from cloud_server.target import keep_path

    log = RoundLog()
    cache, logits = target.prefill(prompt)
    drafter.reset(prompt)
    if server is not None:
        drafter.add_activations(0, server(cache, 0, len(prompt)))
    committed = list(prompt) + [int(logits.argmax())]
    stops = set(target.stop_token_ids())
    while len(committed) - len(prompt) < max_new and committed[-1] not in stops:
        base = len(committed) - 1  # the pending token is not in the cache yet
        start = time.perf_counter()
        tree = drafter.propose(committed, max_nodes)
        drafted = time.perf_counter()
        target_argmax = target.forward_tree(cache, committed[-1], tree).argmax(-1).cpu().numpy()
        acceptance = accept_greedy(tree, target_argmax)
        keep_path(cache, base, acceptance.accepted_nodes)
        verified = time.perf_counter()
        if server is not None:
            drafter.add_activations(base, server(cache, base, cache.get_seq_length()))
        log.server_s += time.perf_counter() - verified
        log.draft_s += drafted - start
        log.verify_s += verified - drafted
        tokens = _through_stop(acceptance.tokens, stops)
        committed += tokens
        log.per_round.append(len(tokens))
    log.tokens = committed[len(prompt):]
    return log


def _through_stop(tokens: tuple[int, ...], stops: set[int]) -> tuple[int, ...]:
    """A round's tokens up to and including the first stop token: the tree may run past it,
    generation may not (the server cuts the same way)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def plain_step_ms(target, repeat: int = 9) -> float:
    """One plain decode step of the target after a 150-token prefix (DESIGN section 7)."""
    from shared.tree import DraftTree

    cache, _ = target.prefill(list(range(100, 250)))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        target.forward_tree(cache, 42, DraftTree((), ()))
        samples.append(1000 * (time.perf_counter() - start))
        cache.crop(-1)
    return statistics.median(samples)


def edge_step_ms(bundle: Path, precision: str, queries: int, context: int = 300,
                 repeat: int = 20) -> float:
    """One call of the edge's step graph: `queries` tree nodes after `context` committed
    tokens, all of them verified (one onnxruntime thread, as the drafter runs it)."""
    import onnxruntime as ort

    from edge_client.drafters.moa_bundle import load_manifest

    manifest = load_manifest(bundle)
    c = manifest["config"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle / manifest["graphs"][precision]["step"]), options)
    kv = np.zeros((c["kv_heads"], context, c["head_dim"]), dtype=np.float32)
    feed = {"ids": np.arange(queries, dtype=np.int64) + 100,
            "positions": np.full(queries, context, dtype=np.int64), "past_keys": kv,
            "past_values": kv, "allowed": np.ones((queries, context + queries), dtype=bool),
            "mem_keys": kv, "mem_values": kv}
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(["top_logprobs", "top_ids", "keys", "values"], feed)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafter", type=Path, required=True, help="trained drafter directory")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--precision", choices=("int8", "fp32"), default="int8",
                   help="the edge graphs' weights")
    p.add_argument("--activations", choices=("fp16", "int8"), default="fp16",
                   help="the activations' wire encoding, applied as a round trip")
    args = p.parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    from cloud_server import model_store
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.reference import compare, plain_greedy
    from cloud_server.target import TargetModel
    from edge_client.drafters.moa import MoaDrafter
    from shared.cache import cache_root

    target = TargetModel.load(*model_store.resolve("default"), "cpu")
    bundle = build_bundle(args.drafter, target.model, target.model_id,
                          cache_root() / "moa-bundles", target.tokenizer_json())
    server = ServerActivations.load(args.drafter, target.model)
    if args.activations == "int8":
        server = _int8_round_trip(server)
    drafter = MoaDrafter(bundle, precision=args.precision, max_depth=args.max_depth)
    rows, per_set, all_rounds, depth_hits = [], {}, [], np.zeros(args.max_depth + 1)
    for name in evaluation.SETS:
        logs = []
        for item in evaluation.load(name, args.per_set):
            prompt = target.apply_chat_template((ChatMessage("user", item["prompt"]),))
            log = split_greedy(target, server, drafter, prompt, args.max_new_tokens,
                               args.max_nodes)
            plain = plain_greedy(target, prompt, args.max_new_tokens)
            same = compare(target, prompt, log.tokens[:args.max_new_tokens], plain).lossless
            logs.append((log, same))
            print(f"{item['id']}: tau {sum(log.per_round) / len(log.per_round):.2f} over "
                  f"{len(log.per_round)} rounds, lossless {same}", file=sys.stderr, flush=True)
            for n in log.per_round:
                depth_hits[:n] += 1
        rounds = [n for log, _ in logs for n in log.per_round]
        all_rounds += rounds
        per_set[name] = sum(rounds) / len(rounds)
        total = len(rounds)
        rows.append((name, len(logs), sum(rounds), total, f"{per_set[name]:.2f}",
                     f"{1000 * sum(lg.draft_s for lg, _ in logs) / total:.1f}",
                     f"{1000 * sum(lg.verify_s for lg, _ in logs) / total:.1f}",
                     f"{1000 * sum(lg.server_s for lg, _ in logs) / total:.1f}",
                     f"{sum(s for _, s in logs)}/{len(logs)}"))
    plain_ms = plain_step_ms(target)
    step1 = edge_step_ms(bundle, args.precision, 1)
    step8 = edge_step_ms(bundle, args.precision, 8)
    header = ("set", "prompts", "tokens", "rounds", "tau", "draft ms/round", "verify ms/round",
              "server half ms/round", "= plain greedy")
    accept = ", ".join(f"{h / len(all_rounds):.2f}" for h in depth_hits[1:args.max_depth + 1])
    text = (f"MoA drafter {args.drafter.name} ({args.precision} graphs, {args.activations} "
            f"activations), greedy, tree <= "
            f"{args.max_nodes} nodes, depth <= {args.max_depth}, {args.max_new_tokens} new "
            f"tokens; {machine()}\n\n{markdown_table(header, rows)}\n\n"
            f"mean tau {sum(all_rounds) / len(all_rounds):.2f}; P(at least d drafts accepted), "
            f"d = 1..{args.max_depth}: {accept}\n"
            f"edge step call: {step1:.2f} ms (1 query), {step8:.2f} ms (8 queries); plain "
            f"target decode step {plain_ms:.1f} ms (ratio {step8 / plain_ms:.3f})\n")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moa_tau.md").write_text(text)
    (RESULTS / "moa_tau.json").write_text(json.dumps({"tau": per_set, "edge_step_ms_1": step1,
                                                      "edge_step_ms_8": step8,
                                                      "plain_step_ms": plain_ms}, indent=1))
    grouped_bars(RESULTS / "moa_tau.png", list(per_set), {"MoA": list(per_set.values())},
                 "tau (tokens per round)", "MoA drafter, greedy, offline (moa_tau.py)")


def _int8_round_trip(server: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    from shared.activation_codec import from_int8, to_int8

    return lambda cache, start, end: from_int8(*to_int8(server(cache, start, end)))


if __name__ == "__main__":
    main()
