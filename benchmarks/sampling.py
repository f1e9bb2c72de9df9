"""Split decoding under sampling: tau and tokens/s per acceptance mode, drafter and temperature.

Beside greedy, at temperatures 0.7 and 1.0, for each lossless sampling rule (docs/architecture.md, Verification)
and each drafter asked for (pld, aded, moa), over loopback; the baseline is transformers
`generate` sampling at the same temperature with the server's kernels (oneDNN), in one run,
every method on each prompt in turn. Prints a table, writes it and a PNG under benchmarks/results/.

    python -m benchmarks.sampling --per-set 2 --max-new-tokens 96
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict

import torch

from shared import prompt_sets as prompts
from benchmarks.common import RESULTS, cloud_server, grouped_bars, machine, markdown_table
from cloud_server import model_store
from cloud_server.model_thread import ModelThread
from cloud_server.target import TargetModel
from edge_client.client import ClientOptions, EdgeClient
from shared.acceptance import AcceptanceMode
from shared.messages import ChatMessage
from shared.sampling import SamplingParams

TEMPERATURES = (0.0, 0.7, 1.0)
MODES = (AcceptanceMode.TOPK_DRAFTS, AcceptanceMode.SAMPLED_DRAFTS, AcceptanceMode.EXPONENTIAL_RACE)


def plain_sample(target: TargetModel, prompt_ids: list[int], max_new: int, temperature: float,
                 seed: int) -> int:
    """Tokens transformers `generate` samples (greedy at temperature 0)."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    stops = list(target.stop_token_ids())
    sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None) \
        if temperature > 0 else dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=max_new, eos_token_id=stops,
                                    pad_token_id=stops[0], **sampling)
    return out.shape[1] - len(prompt_ids)


def configs(drafters: list[str]) -> list[tuple[str, float, AcceptanceMode | None]]:
    greedy = [(d, 0.0, None) for d in drafters]
    return greedy + [(d, t, m) for t in TEMPERATURES[1:] for m in MODES for d in drafters]


async def run(address: str, thread: ModelThread, target: TargetModel, items: list[dict],
              args: argparse.Namespace) -> list[dict]:
    records = []
    for i, item in enumerate(items):
        for temperature in TEMPERATURES:
            start = time.perf_counter()
            n = await thread.run(plain_sample, target, item["prompt_ids"], args.max_new_tokens,
                                 temperature, i)
            records.append({"method": "plain generate", "temperature": temperature,
                            "tokens": n, "wall_s": time.perf_counter() - start, "rounds": 0})
        for drafter, temperature, mode in configs(args.drafters.split(",")):
            options = ClientOptions(drafter, None, args.max_new_tokens,
                                    SamplingParams(temperature, seed=i), mode)
            async with EdgeClient(address, options) as client:
                r = await client.generate(
                    client.options.open_request(prompt_ids=item["prompt_ids"]))
            label = f"split {drafter} {mode.value if mode else 'greedy'}"
            records.append({"method": label, "temperature": temperature,
                            "tokens": len(r.output_ids), "wall_s": r.wall_s,
                            "rounds": r.rounds})
            print(f"  {label:>34} T={temperature} {item['id']:<20} "
                  f"{r.tokens_per_s:6.1f} tok/s tau {r.tau:.2f}", file=sys.stderr, flush=True)
    return records


def summarize(records: list[dict]) -> list[tuple]:
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["temperature"])].append(r)
    speed = {k: sum(r["tokens"] for r in g) / sum(r["wall_s"] for r in g) for k, g in groups.items()}
    rows = []
    for (method, temperature), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rounds = sum(r["rounds"] for r in group)
        tau = (sum(r["tokens"] for r in group) - len(group)) / rounds if rounds else None
        rows.append((method, temperature, f"{speed[(method, temperature)]:.1f}",
                     f"{speed[(method, temperature)] / speed[('plain generate', temperature)]:.2f}x",
                     "-" if tau is None else f"{tau:.2f}"))
    return rows


def plot(rows: list[tuple], path) -> None:
    tau = {(r[0], r[1]): float(r[4]) for r in rows if r[4] != "-"}
    methods = sorted({method for method, _ in tau})
    grouped_bars(path, [f"T={t}" for t in TEMPERATURES],
                 {m: [tau.get((m, t), 0) for t in TEMPERATURES] for m in methods},
                 "tau (tokens per round)",
                 "Split decoding under sampling, SmolLM2-135M-Instruct, per drafter and rule")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafters", default="pld,aded", help="pld, aded, moa (comma-separated)")
    p.add_argument("--name", default="sampling", help="output file stem")
    args = p.parse_args()
    with cloud_server("--device", "cpu") as address:
        thread = ModelThread()  # load and run on one thread, as the server does
        target = thread.call(TargetModel.load, *model_store.resolve("default"), "cpu")
        items = [dict(row, prompt_ids=target.apply_chat_template(
                     (ChatMessage("user", row["prompt"]),)))
                 for name in prompts.SETS for row in prompts.load(name, args.per_set)]
        records = asyncio.run(run(address, thread, target, items, args))
    rows = summarize(records)
    table = markdown_table(("method", "temperature", "tokens/s", "vs plain generate", "tau"),
                           rows)
    text = (f"{len(items)} prompts, {args.max_new_tokens} new tokens max, seed = prompt index; "
            f"{machine()}\n\n{table}\n")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    plot(rows, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
