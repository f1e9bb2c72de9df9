"""Server capacity: how many laptops one cloud-server carries, batched and unbatched.

For 1, 2, 4, 8 and 16 concurrent edge clients (separate processes, started together, each with
its own prompts taken from MT-Bench, HumanEval and GSM8K in turn), every method the edge offers
(split decoding with each edge drafter asked for, server-side speculation, the plain streaming
API) runs against a server that batches the forwards of the sessions ready together (the
default) and one started with `--batch-tokens 0` (one session per forward). Reported: aggregate
and per-client tokens/s, p50/p95 time per token (a generation's time after its first token, per
token), the sessions' forwards, the model's forward passes (one may carry several sessions'
forwards) and server CPU seconds per generated token, from the server's own metrics, and the
client processes' CPU seconds per token (they share this machine with the server), and the share
of the time the model ran forwards (the rest it waited for work). Greedy, so
every prompt's answer must be the same in every configuration: the report counts the answers
that differ (it must be 0).

The edge drafter `oracle` (testkit/profile_oracle.py) drafts from the plain API's answer, right
as often as the shipped MoA drafter is (its acceptance per depth in process, LOG moa_tau_gpu),
at no cost to the client: how a GPU node's capacity is measured on a target whose drafter does
not exist (a random-weight checkpoint of the default's shape, scripts/gpu_check.sh) or with
more clients than the edge's cores could draft for.

    python -m benchmarks.capacity --clients 1,2,4,8,16 --drafters moa,aded
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from benchmarks.common import (free_port, RESULTS, add_placement_args, cloud_server, machine,
                               markdown_table, parse_cores, placement, python_module)
from benchmarks.reliability import log, prompt_items, server_metrics
from cloud_server.device import Device, EngineChoice, Graphs, Precision, Weights
from shared.messages import Pace

METHODS = ("split", "server-spec", "plain-api")
ORACLE = "oracle"  # the drafter that drafts from the plain API's answers
# server kind -> its cloud-server flags and its line style in the plot; `batched-no-load-wait`:
# `auto` waits for drafts under load no longer than when idle (PacingPolicy.load_wait)
SERVERS = {"batched": ((), "-"), "unbatched": (("--batch-tokens", "0"), ":"),
           "batched-no-load-wait": (("--no-load-wait",), "--")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,2,4,8,16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--paces", default=Pace.AUTO.value,
                   help="comma-separated paces split decoding runs at, one method each "
                        "(lockstep, server, auto)")
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="comma-separated server kinds: " + ", ".join(SERVERS))
    p.add_argument("--drafters", default="moa,aded",
                   help="the edge drafters split decoding runs with, one method each "
                        f"({ORACLE}: right at the MoA drafter's measured acceptance, no cost)")
    p.add_argument("--model", default="default", help="as cloud-server --model")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--per-client", type=int, default=2, help="generations each client runs, "
                   "one after another")
    p.add_argument("--name", default="capacity")
    p.add_argument("--start-delay-s", type=float, default=8.0, help="the client processes load "
                   "their drafters before a common start this long after they are launched")
    p.add_argument("--device", choices=[d.value for d in Device], default=Device.CPU.value,
                   help="where the server runs the target (cloud-server --device)")
    p.add_argument("--dtype", choices=[d.value for d in Precision], default=Precision.FP32.value,
                   help="the target's precision there (cloud-server --dtype)")
    p.add_argument("--weights", choices=[w.value for w in Weights], default=Weights.AUTO.value,
                   help="the target's weights (cloud-server --weights)")
    p.add_argument("--engine", choices=[e.value for e in EngineChoice],
                   default=EngineChoice.AUTO.value, help="cloud-server --engine")
    p.add_argument("--graphs", choices=[g.value for g in Graphs], default=Graphs.AUTO.value,
                   help="cloud-server --cuda-graphs")
    p.add_argument("--batch-graphs", choices=("first-use", "start"), default="first-use",
                   help="cloud-server --batch-graphs (start: every batch's shapes captured "
                        "before the server serves, none in a measured cell)")
    add_placement_args(p)
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as one client process
    return p.parse_args(argv)


# One client process ------------------------------------------------------------------------

async def _client(spec: dict) -> None:
    """Generates its prompts one after another from the common start; prints one JSON line
    per answer. A split method reads split[@PACE]:DRAFTER; its pace is auto unless named."""
    import asyncio

    from edge_client.client import ClientOptions, EdgeClient
    from edge_client.drafter_source import DrafterPool
    from edge_client.server_only import Mode
    from shared.messages import ChatMessage
    from testkit.profile_oracle import ProfileOracle, load_profile

    mode, _, drafter = spec["method"].partition(":")
    mode, _, pace = mode.partition("@")
    # the oracle's vocabulary is the server's, known once connected
    oracle = ProfileOracle(load_profile(), vocab_size=0) if drafter == ORACLE else None
    options = ClientOptions("pld" if oracle else drafter or "pld", None,
                            spec["max_new_tokens"], mode=Mode(mode),
                            pace=Pace(pace or Pace.AUTO.value))
    lent = None if oracle is None else DrafterPool(lambda: oracle)
    async with EdgeClient(spec["address"], options, drafters=lent) as client:
        await asyncio.sleep(max(0.0, spec["start_at"] - time.time()))
        for prompt, answer in zip(spec["prompts"], spec["answers"]):
            if oracle is not None:
                oracle.vocab_size = client.tokenizer.get_vocab_size()
                oracle.answer = answer
            start = time.time()
            result = await client.generate(options.open_request(
                chat=(ChatMessage("user", prompt),)))
            print(json.dumps({"prompt": prompt, "ids": result.output_ids, "start": start,
                              "end": time.time(), "ttft_s": result.ttft_s,
                              "wall_s": result.wall_s}), flush=True)


# The run -------------------------------------------------------------------------------------

@dataclass
class Cell:
    """One configuration's outcome."""

    server: str
    method: str
    clients: int
    tokens: int
    seconds: float
    per_token_ms: list[float]
    forwards: float  # forward passes of the target per generated token
    session_forwards: float  # sessions' forwards (verifications, decoding steps) per token
    cpu_s: float  # the server's CPU seconds per token
    client_cpu_s: float  # the edge client processes' CPU seconds per token
    model_busy: float  # the share of the time the model ran forwards
    pass_tokens: float  # new tokens (a tree's nodes, a step's one) per forward pass

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@contextlib.contextmanager
def server(kind: str, metrics_port: int, sessions: int, args: argparse.Namespace) -> Iterator[str]:
    with cloud_server("--quiet", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
                      "--weights", args.weights, "--engine", args.engine,
                      "--cuda-graphs", args.graphs, "--batch-graphs", args.batch_graphs,
                      "--metrics-port", str(metrics_port),
                      "--max-sessions", str(max(sessions, 4)), *SERVERS[kind][0],
                      cores=parse_cores(args.server_cores)) as address:
        yield address


def run_cell(address: str, metrics_port: int, kind: str, method: str, prompts: list[list[str]],
             args: argparse.Namespace, answers_of: dict[str, list[int]]
             ) -> tuple[Cell, list[dict]]:
    """`answers_of`: the plain API's answer to each prompt, for the oracle drafter."""
    before = server_metrics(metrics_port)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_at = time.time() + args.start_delay_s
    procs = [python_module(
        "benchmarks.capacity", ["--client", json.dumps({
            "address": address, "method": method, "prompts": mine,
            "answers": [answers_of.get(prompt, []) for prompt in mine],
            "max_new_tokens": args.max_new_tokens, "start_at": start_at})],
        parse_cores(args.client_cores), stdout=subprocess.PIPE, text=True)
        for mine in prompts]
    answers = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"a client failed ({method}, {kind}): exit {proc.returncode}")
        answers += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    after = server_metrics(metrics_port)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the clients, all reaped now
    client_cpu = (children.ru_utime + children.ru_stime
                  - children_before.ru_utime - children_before.ru_stime)
    tokens = sum(len(a["ids"]) for a in answers)
    spent = {name: after[name] - before.get(name, 0.0)
             for name in ("splitdec_model_forwards_total", "splitdec_forwards_total",
                          "process_cpu_seconds_total", "splitdec_forward_ms_sum",
                          "splitdec_batch_tokens_sum")}
    per_token = [1000 * (a["wall_s"] - a["ttft_s"]) / max(1, len(a["ids"]) - 1) for a in answers]
    seconds = max(a["end"] for a in answers) - min(a["start"] for a in answers)
    cell = Cell(kind, method, len(prompts), tokens, seconds, per_token,
                spent["splitdec_model_forwards_total"] / tokens,
                spent["splitdec_forwards_total"] / tokens,
                spent["process_cpu_seconds_total"] / tokens, client_cpu / tokens,
                spent["splitdec_forward_ms_sum"] / 1000 / seconds,
                spent["splitdec_batch_tokens_sum"] / spent["splitdec_model_forwards_total"])
    return cell, answers


def run(args: argparse.Namespace) -> tuple[list[Cell], int]:
    counts = [int(n) for n in args.clients.split(",")]
    asked = args.methods.split(",")
    paces = ["" if p == Pace.AUTO.value else f"@{p}" for p in args.paces.split(",")]
    methods = [f"split{p}:{d}" for d in args.drafters.split(",") for p in paces
               if "split" in asked]
    methods += [m for m in asked if m != "split"]
    pool = [row["prompt"] for row in prompt_items(max(counts) * args.per_client)]
    cells: list[Cell] = []
    answers_of: dict[str, list[int]] = {}
    differ = 0
    for kind in args.servers.split(","):
        port = free_port()
        with server(kind, port, max(counts), args) as address:
            # unrecorded but for its answers (the oracle drafts from them, and every other
            # cell's must equal them): the 4-bit engine builds its graph for a batch size at
            # the first forward of that many sessions (seconds each), which would fall in the
            # first cell
            _, warm = run_cell(address, port, kind, "plain-api",
                               [pool[i::max(counts)] for i in range(max(counts))], args,
                               answers_of)
            for a in warm:
                differ += answers_of.setdefault(a["prompt"], a["ids"]) != a["ids"]
            for n in counts:
                for method in methods:
                    prompts = [pool[i * args.per_client:(i + 1) * args.per_client]
                               for i in range(n)]
                    cell, answers = run_cell(address, port, kind, method, prompts, args,
                                             answers_of)
                    for a in answers:
                        differ += answers_of.setdefault(a["prompt"], a["ids"]) != a["ids"]
                    cells.append(cell)
                    log(f"{kind:9s} {method:12s} {n:2d} clients: {cell.tok_s:6.1f} tok/s, "
                        f"{cell.session_forwards:.2f} session forwards and "
                        f"{cell.forwards:.2f} forward passes per token, "
                        f"{cell.cpu_s * 1000:.0f} ms server and "
                        f"{cell.client_cpu_s * 1000:.0f} ms client CPU/token")
    return cells, differ


# The report ----------------------------------------------------------------------------------

def table(cells: list[Cell]) -> str:
    unbatched = {(c.method, c.clients): c.tok_s for c in cells if c.server == "unbatched"}
    plain = {(c.server, c.clients): c for c in cells if c.method == "plain-api"}
    rows = []
    for c in cells:
        p50, p95 = np.percentile(c.per_token_ms, [50, 95])
        base = unbatched.get((c.method, c.clients))
        api = plain.get((c.server, c.clients))
        rows.append([c.method, c.server, c.clients, f"{c.tok_s:.1f}",
                     f"{c.tok_s / c.clients:.1f}",
                     "" if base is None else f"{c.tok_s / base:.2f}x",
                     f"{p50:.0f}", f"{p95:.0f}", f"{c.session_forwards:.2f}",
                     "" if api is None else f"{c.session_forwards / api.session_forwards:.2f}x",
                     f"{c.forwards:.2f}",
                     "" if api is None else f"{c.forwards / api.forwards:.2f}x",
                     f"{1000 * c.cpu_s:.0f}", f"{1000 * c.client_cpu_s:.0f}",
                     f"{c.model_busy:.0%}", f"{c.pass_tokens:.1f}"])
    return markdown_table(
        ["method", "server", "clients", "tok/s", "tok/s per client", "vs unbatched",
         "p50 ms/token", "p95 ms/token", "session forwards/token", "vs plain API",
         "forward passes/token", "vs plain API", "server CPU ms/token",
         "clients' CPU ms/token", "model busy", "new tokens/pass"], rows)


def plot(cells: list[Cell], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in dict.fromkeys(c.method for c in cells):
        for kind, (_, style) in SERVERS.items():
            mine = [c for c in cells if c.method == method and c.server == kind]
            if not mine:
                continue
            xs = [c.clients for c in mine]
            line, = left.plot(xs, [c.tok_s for c in mine], style, marker="o",
                              label=f"{method}, {kind}")
            right.plot(xs, [c.forwards for c in mine], style, marker="o",
                       color=line.get_color())
    counts = sorted({c.clients for c in cells})
    for ax, label in ((left, "aggregate tokens/s"), (right, "target forward passes per token")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("concurrent edge clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("One cloud-server, many edge clients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        import asyncio

        asyncio.run(_client(json.loads(args.client)))
        return 0
    cells, differ = run(args)
    report = RESULTS / f"{args.name}.md"
    report.write_text(
        f"# {__doc__.splitlines()[0]}\n\n{machine()}; {placement(args)}; the target on "
        f"{args.device} in {args.dtype}, engine {args.engine}. "
        f"split:DRAFTER is split decoding with that edge drafter; {args.per_client} "
        f"generations of up to {args.max_new_tokens} tokens per client, greedy, over "
        f"loopback.\n\n"
        f"{table(cells)}\n\nAnswers that differ between configurations: {differ}\n")
    plot(cells, RESULTS / f"{args.name}.png")
    print(report.read_text())
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
