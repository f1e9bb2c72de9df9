"""Split decoding with the training-free drafters against the baselines a user would pick.

In one run on one machine: plain transformers `generate` (greedy), transformers prompt-lookup
decoding, and split decoding over loopback (a cloud-server process, the edge client here) for
each drafter, on MT-Bench, HumanEval and GSM8K prompts. Prints a table of tokens/s, the speedup
over plain `generate`, tau and server calls per token; writes the table, raw records and a PNG.
Every split output is checked against plain greedy output (lossless, docs/architecture.md, Verification).

    python benchmarks/training_free.py --per-set 4 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import defaultdict

from shared import prompt_sets as prompts
from benchmarks.common import RESULTS, cloud_server, grouped_bars, machine, markdown_table
from cloud_server import model_store
from cloud_server.model_thread import ModelThread
from cloud_server.reference import compare, plain_greedy
from cloud_server.target import TargetModel
from edge_client.client import ClientOptions, EdgeClient
from shared.messages import ChatMessage, OpenRequest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=4, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default="pld,aded")
    p.add_argument("--tree-nodes", default="auto",
                   help="comma-separated tree budgets to sweep: numbers or 'auto'")
    p.add_argument("--drafter-dir", default="default",
                   help="the MoA drafter the server offers (cloud-server --drafter-dir)")
    p.add_argument("--independent", default=None, metavar="DIR",
                   help="also run the Independent baseline from DIR (a second cloud-server "
                        "offers it; the client drafts with it under the name 'independent')")
    p.add_argument("--name", default="training_free", help="output file stem")
    return p.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


LOCAL_METHODS = ("plain", "prompt-lookup", "plain-onednn", "prompt-lookup-onednn")


def generate_local(target: TargetModel, prompt_ids: list[int], max_new: int,
                   prompt_lookup: bool) -> list[int]:
    """transformers `generate`, greedy, plain or with prompt lookup (10 tokens per draft)."""
    if not prompt_lookup:
        return plain_greedy(target, prompt_ids, max_new)
    import torch

    ids = torch.tensor([prompt_ids])
    stops = list(target.stop_token_ids())
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new, eos_token_id=stops,
                                    pad_token_id=stops[0], prompt_lookup_num_tokens=10,
                                    top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


class Contenders:
    """Every method, runnable on one prompt: local models on their own thread (the thread that
    loaded them, see cloud_server/model_thread.py), split clients against one cloud-server."""

    def __init__(self, max_new: int):
        self.thread = ModelThread()
        spec = model_store.resolve("default")
        self.local = {onednn: self.thread.call(TargetModel.load, *spec, "cpu", onednn=onednn)
                      for onednn in (False, True)}
        self.clients: dict[str, EdgeClient] = {}
        self.max_new = max_new

    @property
    def methods(self) -> list[str]:
        return [*LOCAL_METHODS, *self.clients]

    async def run(self, method: str, item: dict) -> dict:
        record = {"id": item["id"], "set": item["set"], "method": method}
        if method in LOCAL_METHODS:
            target = self.local[method.endswith("onednn")]
            start = time.perf_counter()
            out = await self.thread.run(generate_local, target, item["prompt_ids"],
                                        self.max_new, method.startswith("prompt-lookup"))
            return dict(record, output_ids=out, wall_s=time.perf_counter() - start,
                        rounds=len(out), server_calls=0)
        r = await self.clients[method].generate(
            OpenRequest(prompt_ids=tuple(item["prompt_ids"]), max_new_tokens=self.max_new))
        return dict(record, output_ids=r.output_ids, wall_s=r.wall_s, rounds=r.rounds,
                    tau=r.tau, server_calls=r.server_calls, bytes=r.bytes_up + r.bytes_down)


async def run_all(addresses: dict[str, str], items: list[dict], args: argparse.Namespace,
                  contenders: Contenders) -> list[dict]:
    """Every method on a prompt before the next prompt, so drift in the machine's speed
    (seen here: 25% between runs) lands on all methods alike. `addresses`: the server of each
    drafter name; 'independent' drafts with the bundle its own server offers."""
    names = [*args.drafters.split(","), *(["independent"] if "independent" in addresses else [])]
    configs = [(d, n) for d in names for n in args.tree_nodes.split(",")]
    clients = {f"split-{d}-{n}": EdgeClient(addresses.get(d, addresses["main"]), ClientOptions(
        "moa" if d == "independent" else d, None if n == "auto" else int(n),
        args.max_new_tokens)) for d, n in configs}
    for client in clients.values():
        await client.__aenter__()
    contenders.clients = clients
    records = []
    try:
        for item in items:
            for method in contenders.methods:
                records.append(await contenders.run(method, item))
                r = records[-1]
                log(f"  {method:>22} {item['id']:<22} "
                    f"{len(r['output_ids']) / r['wall_s']:6.1f} tok/s")
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, set) plus an 'all' row per method."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["set"])].append(r)
        groups[(r["method"], "all")].append(r)
    plain_speed = {s: _speed(g) for (m, s), g in groups.items() if m == "plain"}
    onednn_speed = {s: _speed(g) for (m, s), g in groups.items() if m == "plain-onednn"}
    rows = []
    for (method, name), group in groups.items():
        tokens = sum(len(r["output_ids"]) for r in group)
        split = method.startswith("split")
        rows.append({
            "method": method, "set": name, "tokens_per_s": _speed(group),
            "speedup": _speed(group) / plain_speed[name],
            "speedup_same_kernels": _speed(group) / onednn_speed[name],
            "tau": (tokens - len(group)) / sum(r["rounds"] for r in group) if split else None,
            "calls_per_token": sum(r["server_calls"] for r in group) / tokens if split else None,
            "bytes_per_token": sum(r["bytes"] for r in group) / tokens if split else None,
        })
    return rows


def _speed(group: list[dict]) -> float:
    return sum(len(r["output_ids"]) for r in group) / sum(r["wall_s"] for r in group)


def check_lossless(target: TargetModel, items: list[dict], records: list[dict]) -> list[str]:
    """Split outputs that differ from plain greedy output beyond the near-tie rule."""
    plain = {r["id"]: r["output_ids"] for r in records if r["method"] == "plain-onednn"}
    by_id = {item["id"]: item for item in items}
    failures = []
    for r in records:
        if r["method"].startswith("split"):
            verdict = compare(target, by_id[r["id"]]["prompt_ids"], r["output_ids"], plain[r["id"]])
            if not verdict.lossless:
                failures.append(f"{r['method']} {r['id']}: diverges at {verdict.divergence} "
                                f"(top-2 gap {verdict.top2_gap:.2e})")
    return failures


def render(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    body = [(r["method"], r["set"], fmt(r["tokens_per_s"], ".1f"), fmt(r["speedup"], ".2f") + "x",
             fmt(r["speedup_same_kernels"], ".2f") + "x",
             fmt(r["tau"], ".2f"), fmt(r["calls_per_token"], ".3f"),
             fmt(r["bytes_per_token"], ".0f"))
            for r in sorted(rows, key=lambda r: (r["set"] != "all", r["set"], r["method"]))]
    return markdown_table(("method", "set", "tokens/s", "vs plain", "vs plain-onednn", "tau",
                           "server calls/token",
                           "bytes/token"), body)


def plot(rows: list[dict], path) -> None:
    sets = [*prompts.SETS, "all"]
    speed = {(r["method"], r["set"]): r["speedup"] for r in rows}
    series = {m: [speed.get((m, s), 0) for s in sets] for m in sorted({r["method"] for r in rows})}
    grouped_bars(path, sets, series, "tokens/s relative to plain generate",
                 "Greedy decoding, SmolLM2-135M-Instruct on this CPU", baseline=1.0)


def main() -> None:
    args = parse_args()
    log(machine())
    with contextlib.ExitStack() as servers:
        addresses = {"main": servers.enter_context(
            cloud_server("--device", "cpu", "--drafter-dir", args.drafter_dir))}
        if args.independent:
            addresses["independent"] = servers.enter_context(
                cloud_server("--device", "cpu", "--drafter-dir", args.independent))
        # No model work on the main thread: it would slow the model thread (model_thread.py).
        contenders = Contenders(args.max_new_tokens)
        target = contenders.local[True]
        items = [dict(row, prompt_ids=target.apply_chat_template(
                     (ChatMessage("user", row["prompt"]),)))
                 for name in prompts.SETS for row in prompts.load(name, args.per_set)]
        log(f"{len(items)} prompts, {args.max_new_tokens} new tokens each")
        records = asyncio.run(run_all(addresses, items, args, contenders))
    failures = contenders.thread.call(check_lossless, target, items, records)
    rows = summarize(records)
    table = render(rows)
    header = (f"{len(items)} prompts ({args.per_set} per set), greedy, {args.max_new_tokens} new "
              f"tokens max; {machine()}\n\n")
    lossless = f"\nlossless: {'all outputs equal plain greedy' if not failures else failures}\n"
    print(header + table + lossless)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(header + table + "\n" + lossless)
    (RESULTS / f"{args.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot(rows, RESULTS / f"{args.name}.png")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
