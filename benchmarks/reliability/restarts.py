"""Restarts: `edge-client run` answers a prompt over a simulated link while its cloud-server (the
real model) is killed (SIGKILL), drained (SIGTERM) or killed and kept down a while longer, then
started again on the same port. The client rebuilds its session from its history, drafting
offline meanwhile, and must finish with the text of an undisturbed answer."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.reliability import chat, generate, log, prompt_items, server_metrics
from testkit.cli_harness import free_port, server_process

KINDS = (("killed", signal.SIGKILL, 0.0), ("drained", signal.SIGTERM, 0.0),
         ("killed, down 5 s more", signal.SIGKILL, 5.0))
HEADER = ["prompt", "restart", "killed s into the answer", "server back after s", "reconnects",
          "answer s", "same text"]
ANSWER_TIMEOUT_S = 600
ENDED_BEFORE = "answer ended before the restart"  # not a restart: left out of the count


def run_restarts(address: str, count: int, tokens: int, profile: str) -> list[list[object]]:
    """`count` restarts, each kind in turn on each prompt; the undisturbed text comes from the
    benchmark's own server (`address`)."""
    items = prompt_items(-(-count // len(KINDS)))
    rows, rng = [], random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(count):
            item, kind = items[i // len(KINDS)], KINDS[i % len(KINDS)]
            if i % len(KINDS) == 0:
                clean = asyncio.run(generate(address, chat(item["prompt"], tokens)))[0]
            rows.append(restart_once(item, kind, clean, tokens, profile, Path(tmp), rng))
            log(f"restart {i + 1}/{count} ({kind[0]}): same text: {rows[-1][-1]}")
    return rows


def edge_run(port: int, item: dict, tokens: int, profile: str, workdir: Path
             ) -> tuple[subprocess.Popen, Path]:
    prompts, out = workdir / "in.jsonl", workdir / "out.jsonl"
    prompts.write_text(json.dumps({"id": item["id"], "prompt": item["prompt"]}) + "\n")
    out.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--server",
                             f"127.0.0.1:{port}", "--prompts", str(prompts), "--out", str(out),
                             "--max-new-tokens", str(tokens), "--network", profile,
                             "--reconnect-timeout", "300", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, out


def wait_for_session(metrics_port: int, edge: subprocess.Popen) -> None:
    """Until the edge has opened its session (or ended)."""
    deadline = time.monotonic() + 300
    while edge.poll() is None and time.monotonic() < deadline:
        if server_metrics(metrics_port)["splitdec_sessions_open"] >= 1:
            return
        time.sleep(0.1)


def restart_once(item: dict, kind: tuple, clean: list[int], tokens: int, profile: str,
                 workdir: Path, rng: random.Random) -> list[object]:
    name, stop, down_s = kind
    port, metrics = free_port(), free_port()
    server = server_process(port, "--metrics-port", str(metrics))
    edge, out = edge_run(port, item, tokens, profile, workdir)
    try:
        wait_for_session(metrics, edge)
        opened = time.monotonic()
        time.sleep(rng.uniform(0.5, 2.5))  # mid-answer
        if edge.poll() is not None:
            return [item["id"], name, "-", "-", "-", "-", ENDED_BEFORE]
        killed = time.monotonic()
        server.send_signal(stop)
        server.wait(60)
        time.sleep(down_s)
        server = server_process(port, "--metrics-port", str(metrics))
        back = time.monotonic() - killed
        _, err = edge.communicate(timeout=ANSWER_TIMEOUT_S)
        if edge.returncode:
            return [item["id"], name, "-", f"{back:.1f}", "-", "-", f"NO: {err.strip()[-200:]}"]
        record = json.loads(out.read_text())
        return [item["id"], name, f"{killed - opened:.1f}", f"{back:.1f}",
                record["reconnects"], f"{record['wall_s']:.1f}",
                "yes" if record["output_ids"] == clean else "NO"]
    finally:
        if edge.poll() is None:  # it timed out, or the benchmark broke off
            edge.kill()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
