"""Split decoding against what a user would run instead, over simulated links.

For each link profile (netsim/), in one run against one cloud-server process, every
prompt in turn through: (a) a plain streaming API (the server decodes token by token and streams),
(b) server-side speculative decoding with the server's lookup drafter, (c) split decoding at each
pace (lockstep, server, auto), each method through a client of its own and the order rotated
prompt by prompt. Reports tokens/s, time to first token, p50/p95 inter-token
latency, server calls and target forwards per generated token, wire bytes per token, the share
of tokens the edge drafted, what became of a paced method's drafts (used by a forward, too
late, wrong from their first token), and for lockstep the link bound tau / (RTT + T_verify).
Then a scripted outage on one profile: what it costs against the same generation without it.
Writes a table, raw records and a PNG. The link is a netsim proxy process on the clients' cores.

    python -m benchmarks.latency --per-set 1 --max-new-tokens 64 [--device cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator

import numpy as np

from shared import prompt_sets as prompts
from benchmarks.common import (RESULTS, add_placement_args, cloud_server, machine,
                               markdown_table, netsim_proxy, parse_cores, placement)
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafter_source import DrafterPool
from edge_client.reporting import GenerationResult, SilentListener
from edge_client.server_only import SERVER_DRAFTER, Mode, server_generate
from shared.messages import ChatMessage, OpenRequest, Pace
from cloud_server.device import Weights
from netsim import PROFILES, NetworkConditions, OutageMode

# split methods: the pace each asks for
SPLIT_PACES = {"split-lockstep": Pace.LOCKSTEP, "split-server": Pace.SERVER,
               "split-auto": Pace.AUTO}
# what became of a paced method's drafts, as the table and the plot show them (DraftOutcomes)
OUTCOMES = ("used", "late", "wrong")
METHODS = ("plain-api", "server-spec", "split-lockstep", "split-server", "split-auto")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=1, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profiles", default=",".join(p for p in PROFILES if "lossy" not in p))
    p.add_argument("--drafter", default="pld", help="the split client's drafter")
    p.add_argument("--drafter-dir", default="default",
                   help="the trained drafter the server offers (cloud-server --drafter-dir: "
                        "default, falcon, none or a directory)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated, from: plain-api, server-spec, "
                        + ", ".join(SPLIT_PACES))
    p.add_argument("--outage-profile", default="4g")
    p.add_argument("--outage-s", type=float, default=3.0, help="0: no outage runs")
    p.add_argument("--outage-max-new-tokens", type=int, default=192,
                   help="the outage runs' answer length: long enough that the outage, 2 s in, "
                        "falls inside the answer (64 tokens took 1.9 s on `4g` here)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the server runs the target (cloud-server --device; fp32)")
    p.add_argument("--weights", choices=[w.value for w in Weights], default=Weights.AUTO.value,
                   help="the target's weights (cloud-server --weights)")
    p.add_argument("--name", default="latency", help="output file stem")
    add_placement_args(p)
    args = p.parse_args()
    args.methods = args.methods.split(",")
    if unknown := set(args.methods) - {"plain-api", "server-spec", *SPLIT_PACES}:
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if "plain-api" not in args.methods:
        p.error("--methods must include plain-api, the baseline of every ratio")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Arrivals(SilentListener):
    """When each generated token reached the client, from the moment the request left."""

    start: float = field(default_factory=time.perf_counter)
    times: list[float] = field(default_factory=list)

    def committed(self, ids: list[int]) -> None:
        self.times += [time.perf_counter() - self.start] * len(ids)

    def stats(self) -> dict:
        gaps = np.diff(self.times) * 1000 if len(self.times) > 1 else np.zeros(1)
        return {"ttft_s": self.times[0], "wall_s": self.times[-1],
                "itl_p50_ms": float(np.percentile(gaps, 50)),
                "itl_p95_ms": float(np.percentile(gaps, 95))}


def record(r: GenerationResult, arrivals: Arrivals) -> dict:
    return {**arrivals.stats(), "output_ids": r.output_ids, "forwards": r.rounds,
            "server_calls": r.server_calls, "bytes": r.bytes_up + r.bytes_down,
            "verify_ms": 1000 * r.verify_s, "rounds": r.rounds,
            "accepted_tokens": r.accepted_tokens,
            "hidden_draft_ms": 1000 * r.hidden_draft_s, "draft_ms": 1000 * r.draft_s,
            "speculations": r.speculations, "speculation_hits": r.speculation_hits,
            "reconnects": r.reconnects, "outage_s": r.outage_s,
            "offline_tokens": r.offline_tokens, "corrected_tokens": r.corrected_tokens,
            "drafts": asdict(r.drafts)}


async def run_method(client: EdgeClient, method: str, request: OpenRequest) -> dict:
    """One generation through the product's own client: split at a pace, or a baseline."""
    arrivals = Arrivals()
    if method in SPLIT_PACES:
        r = await client.generate(replace(request, pace=SPLIT_PACES[method]), arrivals)
    else:
        r = await server_generate(client.link, request, Mode(method), arrivals)
    return record(r, arrivals)


@contextlib.asynccontextmanager
async def method_clients(proxy: str, methods: list[str], drafter: str, max_new_tokens: int,
                         warm_prompt: str, drafters: DrafterPool | None = None
                         ) -> AsyncIterator[dict[str, EdgeClient]]:
    """One client per method: what a user who runs only that method has, so nothing one
    method's generations leave behind (the edge's rest, which a client carries to its next
    generation) reaches another's. (gRPC shares one connection among them.) A fresh channel's
    first server stream arrives in bursts (seen here: 200 ms apart, then smooth): one short
    run of each method first keeps that out. `drafters`: lent to the split clients in place
    of `drafter` (EdgeClient's)."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {m: await stack.enter_async_context(
            EdgeClient(proxy, ClientOptions(drafter, None, max_new_tokens), drafters=drafters))
            for m in methods}
        warm = OpenRequest(chat=(ChatMessage("user", warm_prompt),), max_new_tokens=4)
        for method, client in clients.items():
            await run_method(client, method, warm)
        yield clients


def rotated(methods: list[str], turn: int) -> list[str]:
    """`methods` from the turn-th on, wrapping: prompt by prompt each method goes first as
    often as the others, so none always follows the same one."""
    k = turn % len(methods)
    return methods[k:] + methods[:k]


async def generations(address: str, profile: str, items: list[dict], args
                      ) -> AsyncIterator[tuple[str, dict, EdgeClient, OpenRequest]]:
    """Every (method, prompt) of one link profile, in the order they run, with the method's
    client and the request: behind a netsim proxy on the clients' cores, each prompt through
    every method, the order rotated prompt by prompt."""
    with netsim_proxy(address, profile, cores=parse_cores(args.client_cores)) as proxy:
        async with method_clients(proxy, args.methods, args.drafter, args.max_new_tokens,
                                  items[0]["prompt"]) as clients:
            for turn, item in enumerate(items):
                request = OpenRequest(chat=(ChatMessage("user", item["prompt"]),),
                                      max_new_tokens=args.max_new_tokens)
                for method in rotated(args.methods, turn):
                    yield method, item, clients[method], request


async def run_profile(address: str, profile: str, items: list[dict], args) -> list[dict]:
    conditions = NetworkConditions.symmetric(PROFILES[profile])
    records = []
    async for method, item, client, request in generations(address, profile, items, args):
        done = await run_method(client, method, request)
        records.append({"profile": profile, "rtt_ms": conditions.rtt_ms, "method": method,
                        "id": item["id"], **done})
        log(f"  {profile:>9} {method:>14} {item['id']:<20} "
            f"{len(done['output_ids']) / done['wall_s']:6.1f} tok/s")
    return records


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for profile in dict.fromkeys(r["profile"] for r in records):
        plain = _group(records, profile, "plain-api")
        for method in dict.fromkeys(r["method"] for r in records):
            group = _group(records, profile, method)
            tokens = sum(len(r["output_ids"]) for r in group)
            speed = tokens / sum(r["wall_s"] for r in group)
            row = {"profile": profile, "rtt_ms": group[0]["rtt_ms"], "method": method,
                   "tokens_per_s": speed,
                   "vs_plain_api": speed / (sum(len(r["output_ids"]) for r in plain)
                                            / sum(r["wall_s"] for r in plain)),
                   "ttft_ms": 1000 * np.mean([r["ttft_s"] for r in group]),
                   "itl_p50_ms": np.mean([r["itl_p50_ms"] for r in group]),
                   "itl_p95_ms": np.mean([r["itl_p95_ms"] for r in group]),
                   "calls_per_token": sum(r["server_calls"] for r in group) / tokens,
                   "forwards_per_token": sum(r["forwards"] for r in group) / tokens,
                   "bytes_per_token": sum(r["bytes"] for r in group) / tokens,
                   "draft_ms_per_token": sum(r["draft_ms"] for r in group) / tokens,
                   "link_bound": None, "identical": _identical(records, profile, method),
                   "vs_server_spec": paired_ratio(records, profile, method, "server-spec"),
                   "client_share": (sum(r["accepted_tokens"] for r in group) / tokens
                                    if method in SPLIT_PACES else None),
                   "drafts": {k: sum(r["drafts"][k] for r in group if "drafts" in r)
                              for k in OUTCOMES}}
            if method == "split-lockstep":
                rounds = sum(r["rounds"] for r in group)
                tau = (tokens - len(group)) / rounds
                verify_s = sum(r["verify_ms"] for r in group) / rounds / 1000
                row["link_bound"] = tau / (group[0]["rtt_ms"] / 1000 + verify_s)
            rows.append(row)
    return rows


def paired_ratio(records: list[dict], profile: str, method: str, baseline: str
                 ) -> tuple[float, float, float] | None:
    """`method`'s tokens/s over `baseline`'s on the same prompt, as a geometric mean over the
    prompts with a 95% bootstrap interval (None: either is missing, or it is the baseline).
    Each prompt ran every method back to back, so the VM's drift between prompts cancels and
    the interval says whether a difference is more than this run's noise."""
    base = {r["id"]: r for r in _group(records, profile, baseline)}
    pairs = [(r, base[r["id"]]) for r in _group(records, profile, method) if r["id"] in base]
    if method == baseline or len(pairs) < 2:
        return None
    logs = np.log([(len(r["output_ids"]) / r["wall_s"]) / (len(b["output_ids"]) / b["wall_s"])
                   for r, b in pairs])
    means = np.random.default_rng(0).choice(logs, (10_000, len(logs))).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def _group(records: list[dict], profile: str, method: str) -> list[dict]:
    return [r for r in records if r["profile"] == profile and r["method"] == method]


def _identical(records: list[dict], profile: str, method: str) -> str:
    plain = {r["id"]: r["output_ids"] for r in _group(records, profile, "plain-api")}
    group = _group(records, profile, method)
    same = sum(r["output_ids"] == plain[r["id"]] for r in group)
    return f"{same}/{len(group)}"


async def outage_cost(address: str, item: dict, args, mode: OutageMode) -> dict:
    """The same split generation without and with one outage 2 s in; the difference is what
    the outage cost, to set against its length plus one round."""
    tokens = args.outage_max_new_tokens
    request = OpenRequest(chat=(ChatMessage("user", item["prompt"]),), max_new_tokens=tokens)
    runs = {}
    for label, outages in (("clean", ()), ("outage", ((2.0, args.outage_s),))):
        with netsim_proxy(address, args.outage_profile, outages, mode.value,
                          parse_cores(args.client_cores)) as proxy:
            async with EdgeClient(proxy, ClientOptions(args.drafter, None, tokens)) as client:
                runs[label] = await run_method(client, "split-auto", request)
    clean, hit = runs["clean"], runs["outage"]
    round_s = clean["wall_s"] / max(1, clean["rounds"])
    return {"mode": mode.value, "outage_s": args.outage_s, "clean_s": clean["wall_s"],
            "with_outage_s": hit["wall_s"], "cost_s": hit["wall_s"] - clean["wall_s"],
            "round_s": round_s, "offline_tokens": hit["offline_tokens"],
            "corrected_tokens": hit["corrected_tokens"], "reconnects": hit["reconnects"],
            "identical": hit["output_ids"] == clean["output_ids"]}


def render(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    body = [(r["profile"], f"{r['rtt_ms']:g}", r["method"], fmt(r["tokens_per_s"], ".1f"),
             fmt(r["vs_plain_api"], ".2f") + "x", _interval(r["vs_server_spec"]),
             fmt(r["ttft_ms"], ".0f"),
             fmt(r["itl_p50_ms"], ".0f"), fmt(r["itl_p95_ms"], ".0f"),
             fmt(r["calls_per_token"], ".3f"), fmt(r["forwards_per_token"], ".2f"),
             fmt(r["bytes_per_token"], ".0f"), fmt(r["draft_ms_per_token"], ".1f"),
             "-" if r["client_share"] is None else f"{r['client_share']:.0%}",
             _outcomes(r["drafts"]),
             fmt(r["link_bound"], ".1f") if r["link_bound"] is None
             else f"{r['link_bound']:.1f} ({r['tokens_per_s'] / r['link_bound']:.0%})",
             r["identical"]) for r in rows]
    return markdown_table(("link", "RTT ms", "method", "tok/s", "vs plain API",
                           "vs server-spec per prompt (95% CI)", "TTFT ms",
                           "ITL p50 ms", "ITL p95 ms", "calls/token", "target fwd/token",
                           "bytes/token", "edge drafting ms/token", "client-drafted",
                           "paced drafts used / late / wrong",
                           "lockstep link bound tok/s (reached)", "same text"), body)


def _outcomes(drafts: dict[str, int]) -> str:
    """Shares of a paced method's settled drafts (reporting.py, DraftOutcomes)."""
    settled = sum(drafts.values())
    if not settled:
        return "-"
    shares = " / ".join(f"{drafts[k] / settled:.0%}" for k in OUTCOMES)
    return f"{shares} of {settled}"


def _interval(ratio: tuple[float, float, float] | None) -> str:
    return "-" if ratio is None else "{:.3f} [{:.3f}, {:.3f}]".format(*ratio)


def render_outages(rows: list[dict], profile: str, tokens: int) -> str:
    body = [(r["mode"], f"{r['outage_s']:g}", f"{r['clean_s']:.2f}", f"{r['with_outage_s']:.2f}",
             f"{r['cost_s']:.2f}", f"{r['outage_s'] + r['round_s']:.2f}", r["offline_tokens"],
             r["corrected_tokens"], "yes" if r["identical"] else "NO") for r in rows]
    return (f"Outage on `{profile}`, split decoding, {tokens} new tokens:\n\n" + markdown_table(
        ("mode", "outage s", "clean run s", "with outage s", "cost s", "outage + 1 round s",
         "offline tokens", "corrected", "same text"), body))


def plot(rows: list[dict], path, device: str = "cpu") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, work, fate) = plt.subplots(1, 3, figsize=(17, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        speed.plot([r["rtt_ms"] for r in mine], [r["tokens_per_s"] for r in mine], "o-",
                   label=method)
    split = [r for r in rows if r["method"] == "split-lockstep"]
    speed.plot([r["rtt_ms"] for r in split], [r["link_bound"] for r in split], "k:",
               label="lockstep link bound tau/(RTT+T_verify)")
    speed.set_xscale("symlog", linthresh=10)
    speed.set_xlabel("round-trip time, ms (netsim profiles)")
    speed.set_ylabel("generated tokens/s")
    speed.legend(fontsize=8)
    speed.set_title("Tokens/s vs link RTT")
    per_method = {m: np.mean([r["forwards_per_token"] for r in rows if r["method"] == m])
                  for m in methods}
    work.bar(list(per_method), list(per_method.values()),
             color=[f"C{i}" for i in range(len(per_method))])
    work.tick_params(axis="x", labelrotation=20)
    work.set_ylabel("target forward passes per generated token")
    work.set_title("Server work per token")
    plot_outcomes(fate, rows)
    fig.suptitle(f"SmolLM2-135M-Instruct, {device.upper()} server on loopback behind netsim")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_outcomes(ax, rows: list[dict]) -> None:
    """Stacked shares of the last paced method's drafts per link: used, late, wrong."""
    paced = [m for m in dict.fromkeys(r["method"] for r in rows)
             if m in SPLIT_PACES and m != "split-lockstep"]
    mine = [r for r in rows if paced and r["method"] == paced[-1] and sum(r["drafts"].values())]
    if not mine:
        ax.set_axis_off()
        return
    links = [r["profile"] for r in mine]
    settled = np.array([sum(r["drafts"].values()) for r in mine])
    bottom = np.zeros(len(mine))
    for outcome, color in zip(OUTCOMES, ("C2", "C1", "C3")):
        share = np.array([r["drafts"][outcome] for r in mine]) / settled
        ax.bar(links, share, bottom=bottom, color=color, label=outcome)
        bottom += share
    for x, count in enumerate(settled):
        ax.text(x, 1.01, str(count), ha="center", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("share of settled drafts (count above)")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"What became of {paced[-1]}'s drafts")


def main() -> None:
    args = parse_args()
    log(machine())
    items = [row for name in prompts.SETS for row in prompts.load(name, args.per_set)]
    with cloud_server("--device", args.device, "--weights", args.weights,
                      "--drafter-dir", args.drafter_dir,
                      cores=parse_cores(args.server_cores)) as address:
        if client_cores := parse_cores(args.client_cores):
            os.sched_setaffinity(0, client_cores)  # this process: the clients and the links
        records = []
        for profile in args.profiles.split(","):
            records += asyncio.run(run_profile(address, profile, items, args))
        outages = [asyncio.run(outage_cost(address, items[0], args, mode))
                   for mode in (OutageMode.CUT, OutageMode.BLACKHOLE) if args.outage_s > 0]
    rows = summarize(records)
    header = (f"{len(items)} prompts ({args.per_set} per set), greedy, {args.max_new_tokens} "
              f"new tokens max, split drafter {args.drafter}, server-spec drafter "
              f"{SERVER_DRAFTER}; the target on {args.device}, --weights {args.weights}; "
              f"{machine()}; "
              f"{placement(args)}\n\n")
    text = header + render(rows) + "\n"
    if outages:
        text += ("\n" + render_outages(outages, args.outage_profile, args.outage_max_new_tokens)
                 + "\n")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records + outages))
    plot(rows, RESULTS / f"{args.name}.png", args.device)


if __name__ == "__main__":
    main()
