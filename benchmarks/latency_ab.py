"""Two runs of the latency benchmark set side by side: a change against the code before it.

For every link and method: each run's token rate against its own plain API (so the machine's
drift between the runs cancels), their ratio, target forwards per token in each, and whether
every text is the same in both runs, prompt by prompt. Writes a table and a PNG.

    python -m benchmarks.latency_ab --before RESULTS/a.jsonl --after RESULTS/b.jsonl --name ab
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS, grouped_bars, markdown_table, write_results
from benchmarks.latency import summarize


def load(path: Path) -> list[dict]:
    """A latency run's per-generation records (its outage records left out)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "method" in r and "profile" in r]


def same_texts(before: list[dict], after: list[dict], profile: str, method: str) -> str:
    """How many of the prompts got the same text in both runs, as 'n/m'."""
    def texts(records: list[dict]) -> dict[str, list[int]]:
        return {r["id"]: r["output_ids"] for r in records
                if r["profile"] == profile and r["method"] == method}
    old, new = texts(before), texts(after)
    return f"{sum(old.get(k) == ids for k, ids in new.items())}/{len(new)}"


def compare(before: list[dict], after: list[dict]) -> list[dict]:
    old = {(r["profile"], r["method"]): r for r in summarize(before)}
    rows = []
    for row in summarize(after):
        key = (row["profile"], row["method"])
        if key not in old:
            continue
        was = old[key]
        rows.append({"profile": row["profile"], "method": row["method"],
                     "before": was["vs_plain_api"], "after": row["vs_plain_api"],
                     "ratio": row["vs_plain_api"] / was["vs_plain_api"],
                     "fwd_before": was["forwards_per_token"],
                     "fwd_after": row["forwards_per_token"],
                     "same": same_texts(before, after, *key)})
    return rows


def render(rows: list[dict]) -> str:
    body = [(r["profile"], r["method"], f"{r['before']:.2f}x", f"{r['after']:.2f}x",
             f"{r['ratio']:.3f}", f"{r['fwd_before']:.2f}", f"{r['fwd_after']:.2f}", r["same"])
            for r in rows]
    return markdown_table(("link", "method", "vs plain API, before", "vs plain API, after",
                           "after / before", "fwd/token before", "fwd/token after",
                           "same text in both"), body)


def plot(rows: list[dict], path: Path) -> None:
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain-api"]
    ratio = {(r["profile"], r["method"]): r["ratio"] for r in rows}
    grouped_bars(path, profiles, {m: [ratio.get((p, m), 0.0) for p in profiles] for m in methods},
                 "after / before (each against its own plain API)",
                 "The change against the code before it, per link", baseline=1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a latency run's .jsonl")
    p.add_argument("--after", type=Path, required=True, help="a latency run's .jsonl")
    p.add_argument("--name", required=True, help="output file stem")
    args = p.parse_args()
    rows = compare(load(args.before), load(args.after))
    write_results(args.name, f"before: {args.before.name}, after: {args.after.name}\n\n"
                  + render(rows) + "\n")
    plot(rows, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
