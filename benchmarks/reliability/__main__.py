"""python -m benchmarks.reliability: every part in one run, one report and one plot.

    python -m benchmarks.reliability --fuzz-cases 10000 --storm-prompts 72 --restarts 21 \\
        --soak-clients 16 --soak-minutes 10
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.common import free_port, RESULTS, cloud_server, machine, markdown_table
from benchmarks.reliability import log, server_metrics
from benchmarks.reliability import fuzz, restarts, soak, storms

PARTS = ("fuzz", "storms", "restarts", "soak")
IDLE_TIMEOUT_S = 10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="which parts, comma-separated")
    p.add_argument("--fuzz-cases", type=int, default=10_000,
                   help="Decode calls to fuzz, half message sequences, half mutated bytes")
    p.add_argument("--storm-prompts", type=int, default=72)
    p.add_argument("--storm-profiles", default="4g,4g-lossy")
    p.add_argument("--storm-concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--restarts", type=int, default=21)
    p.add_argument("--restart-tokens", type=int, default=128)
    p.add_argument("--profile", default="4g", help="the link of the restarts and the soak")
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--max-sessions", type=int, default=12)
    p.add_argument("--name", default="reliability")
    args = p.parse_args()
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown parts {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    return args


def fuzz_section(result: dict) -> tuple[list[list[object]], str]:
    tallies = result["tallies"]
    calls = sum(t.sequences for t in tallies.values())
    messages = sum(t.messages for t in tallies.values())
    ok = not result["failure"] and result["healthy exact"] and not result["internal errors"] \
        and not result["sessions left"] and not result["restarted"]
    summary = [["Decode calls fuzzed", f"{calls:,} ({messages:,} messages): "
                + ", ".join(f"{n:,} {name}" for name, n in
                            ((k, t.sequences) for k, t in tallies.items()))
                + (", every one a clear status" if not result["failure"]
                   else f"; FAILED: {result['failure']}")]]
    rows = [*[[f"{name}: statuses", t.summary()] for name, t in tallies.items()],
            ["healthy greedy answers beside the fuzzer, all exact",
             f"{result['healthy']}, {'yes' if result['healthy exact'] else 'NO'}"],
            ["healthy Opens refused RESOURCE_EXHAUSTED (the fuzzer's orphaned sessions held "
             "the table until their idle timeout), then retried", result["healthy refused"]],
            ["calls the server ended INTERNAL", f"{result['internal errors']:.0f}"],
            ["sessions left after the idle timeout", f"{result['sessions left']:.0f}"],
            ["server restarted (crashed) meanwhile", "yes" if result["restarted"] else "no"]]
    return summary, ("## Fuzzing (tiny model)\n\n" + markdown_table(["", "value"], rows)
                     + f"\n\n{'Passed' if ok else 'FAILED'}.\n")


def storm_section(rows: list[list[object]], args: argparse.Namespace
                  ) -> tuple[list[list[object]], str]:
    same = sum(r[-1] == "yes" for r in rows)
    outages = sum(int(r[3]) for r in rows)
    summary = [["outages survived", f"{outages} in {len(rows)} answers on "
                f"{args.storm_profiles}, cut and black hole; same text {same}/{len(rows)}"]]
    text = (f"## Outage storms ({args.max_new_tokens} new tokens, outages of 0.2-10 s, 0.5-3 s "
            f"apart, {args.storm_concurrency} answers at a time)\n\n"
            + markdown_table(storms.SUMMARY_HEADER, storms.storm_summary(rows))
            + "\n\nEvery answer:\n\n" + markdown_table(storms.HEADER, rows) + "\n")
    return summary, text


def restart_section(rows: list[list[object]], args: argparse.Namespace
                    ) -> tuple[list[list[object]], str]:
    done = [r for r in rows if r[-1] != restarts.ENDED_BEFORE]  # a failed restart counts
    same = sum(r[-1] == "yes" for r in done)
    summary = [["restarts survived", f"{same}/{len(done)} with the same text "
                f"({'; '.join(k[0] for k in restarts.KINDS)} in turn, {args.profile}, "
                f"{args.restart_tokens} new tokens)"]]
    return summary, (f"## Restarts (real model, {args.profile})\n\n"
                     + markdown_table(restarts.HEADER, rows) + "\n")


def soak_section(rows: list[list[object]], args: argparse.Namespace
                 ) -> tuple[list[list[object]], str]:
    summary = [["soak", f"{args.soak_clients} clients, {args.soak_minutes:g} min against "
                f"--max-sessions {args.max_sessions}; {rows[0][0]}: {rows[0][1]}"]]
    return summary, (f"## Soak ({args.soak_clients} clients, {args.soak_minutes:g} min, "
                     f"--max-sessions {args.max_sessions}, random 2 s outages twice a minute, a "
                     "quarter of the clients exiting mid-answer)\n\n"
                     + markdown_table(["", "value"], rows) + "\n")


def main() -> int:
    args = parse_args()
    summary, sections, storm_rows, restart_rows = [], [], [], []
    if "fuzz" in args.parts:
        part = fuzz_section(fuzz.run_fuzz(args.fuzz_cases))
        summary += part[0]
        sections.append(part[1])
    metrics_port = free_port()
    with cloud_server("--quiet", "--max-sessions", str(args.max_sessions), "--idle-timeout",
                      str(IDLE_TIMEOUT_S), "--metrics-port", str(metrics_port)) as address:
        started = server_metrics(metrics_port)["process_start_time_seconds"]
        if "storms" in args.parts:
            storm_rows = storms.run_storms(address, args.storm_prompts, args.max_new_tokens,
                                           args.storm_profiles.split(","),
                                           args.storm_concurrency)
            part = storm_section(storm_rows, args)
            summary += part[0]
            sections.append(part[1])
        if "restarts" in args.parts:
            restart_rows = restarts.run_restarts(address, args.restarts, args.restart_tokens,
                                                 args.profile)
            part = restart_section(restart_rows, args)
            summary += part[0]
            sections.append(part[1])
        if "soak" in args.parts:
            part = soak_section(soak.run_soak(address, metrics_port, args.soak_clients,
                                              args.soak_minutes, args.profile, IDLE_TIMEOUT_S),
                                args)
            summary += part[0]
            sections.append(part[1])
        crashed = server_metrics(metrics_port)["process_start_time_seconds"] != started
    summary.append(["the real-model server crashed or restarted", "yes" if crashed else "no"])
    report = (f"# Reliability\n\nMachine: {machine()}; clients and servers share it.\n\n"
              + markdown_table(["", "figure"], summary) + "\n\n" + "\n".join(sections))
    (RESULTS / f"{args.name}.md").write_text(report)
    plot(storm_rows, restart_rows, RESULTS / f"{args.name}.png")
    print(report)
    log(f"wrote {RESULTS / args.name}.md and .png")
    return 0


def plot(storm_rows: list[list[object]], restart_rows: list[list[object]], path) -> None:
    """Left: each storm answer's time against its clean time plus its time without a link
    (on the diagonal: nothing lost beyond the outages). Right: each restart's answer time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for profile in sorted({str(r[1]) for r in storm_rows}):
        mine = [r for r in storm_rows if r[1] == profile]
        left.scatter([float(r[6]) + float(r[4]) for r in mine], [float(r[7]) for r in mine],
                     s=14, label=profile)
    top = max([float(r[7]) for r in storm_rows] or [1.0])
    left.plot([0, top], [0, top], color="gray", linewidth=0.8, label="nothing lost")
    left.set_xlabel("clean answer s + s without a link")
    left.set_ylabel("answer s through the storm")
    left.set_title("Outage storms: same text in every answer")
    left.legend(fontsize=8)
    done = [r for r in restart_rows if r[5] != "-"]
    at = range(len(done))
    right.bar([i - 0.2 for i in at], [float(r[3]) for r in done], 0.4,
              label="server back after s")
    right.bar([i + 0.2 for i in at], [float(r[5]) for r in done], 0.4, label="answer s")
    right.set_xticks(at, [str(r[1]) for r in done], rotation=90, fontsize=7)
    right.set_title("Restarts mid-answer")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
