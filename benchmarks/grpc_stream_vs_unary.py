"""Per-round latency on grpc.aio over loopback: one bidi stream per generation vs one unary call per round.

Why this exists: grpc's performance guide advises streams for long-lived flows, then says that
advice does not hold for Python (https://grpc.io/docs/guides/performance, "Python"). Each
speculative round sends one draft tree and gets one verdict back, so we measure which shape is
cheaper. The server echoes a fixed-size response with no model work: transport cost alone.
The separate-process rows are the ones that matter, since the real verifier is another process.

    python benchmarks/grpc_stream_vs_unary.py --rounds 2000 --out-dir benchmarks/results
"""
from __future__ import annotations

import argparse
import asyncio
import enum
import multiprocessing as mp
import os
import platform
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

SERVICE = "bench.Echo"
N_DRAFT = 32  # draft-tree nodes per round
SIZES = (100, 32 * 640 * 2)  # a verdict; fresh activations [32 tokens, 640] fp16 = 40 KiB
RESPONSES = {size: os.urandom(size) for size in SIZES}
WARMUP_GENERATIONS = 6
ROUND_DEADLINE_S, GENERATION_DEADLINE_S = 5.0, 60.0
Latencies = dict[int, dict[str, np.ndarray]]  # response size -> variant -> [rounds] µs


class Placement(enum.Enum):
    SEPARATE_PROCESS = "separate process"
    SAME_PROCESS = "same process"


def _identity(message: bytes) -> bytes:
    return message


def make_request(response_size: int) -> bytes:
    """300 bytes: a 44-byte header (response size, session, round), then tokens and parents."""
    tokens = np.arange(N_DRAFT, dtype=np.int32)  # [N_DRAFT]
    parents = np.arange(-1, N_DRAFT - 1, dtype=np.int32)  # [N_DRAFT], a chain
    return response_size.to_bytes(4, "little") + bytes(40) + tokens.tobytes() + parents.tobytes()


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return RESPONSES[int.from_bytes(request[:4], "little")]


async def _stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield RESPONSES[int.from_bytes(request[:4], "little")]


async def start_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream, _identity, _identity),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def serve_in_child(conn: Connection) -> None:
    """Child-process entry: send the port back, serve until the parent sends anything."""
    async def serve() -> None:
        server, port = await start_server()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(grace=1.0)
    asyncio.run(serve())


async def generation(channel: grpc.aio.Channel, request: bytes, n: int) -> dict[str, list[int]]:
    """n rounds on one stream (opening it is charged to its first round), then n unary calls."""
    stream = channel.stream_stream(f"/{SERVICE}/Stream", _identity, _identity)(timeout=GENERATION_DEADLINE_S)
    unary = channel.unary_unary(f"/{SERVICE}/Unary", _identity, _identity)
    ns: dict[str, list[int]] = {"stream": [], "unary": []}
    t0 = time.perf_counter_ns()
    for _ in range(n):
        await stream.write(request)
        await stream.read()
        t1 = time.perf_counter_ns()
        ns["stream"].append(t1 - t0)
        t0 = t1
    await stream.done_writing()
    if (code := await stream.code()) != grpc.StatusCode.OK:
        raise RuntimeError(f"stream ended with {code}")
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await unary(request, timeout=ROUND_DEADLINE_S)
        ns["unary"].append(time.perf_counter_ns() - t0)
    return ns


async def measure(port: int, rounds: int, per_gen: int) -> Latencies:
    """Alternates stream and unary generation by generation, so drift hits both alike."""
    results: Latencies = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # one channel, reused
        for size in SIZES:
            request, ns = make_request(size), {"stream": [], "unary": []}
            for start in range(-WARMUP_GENERATIONS * per_gen, rounds, per_gen):
                timed = await generation(channel, request, min(per_gen, rounds - start))
                if start >= 0:  # negative starts are warm-up
                    for variant, latencies in timed.items():
                        ns[variant] += latencies
            results[size] = {variant: np.array(v) / 1e3 for variant, v in ns.items()}
    return results


async def run_same_process(rounds: int, per_gen: int) -> Latencies:
    server, port = await start_server()
    try:
        return await measure(port, rounds, per_gen)
    finally:
        await server.stop(grace=1.0)


def run_separate_process(rounds: int, per_gen: int) -> Latencies:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=serve_in_child, args=(child,), daemon=True)
    proc.start()
    try:
        return asyncio.run(measure(parent.recv(), rounds, per_gen))
    finally:
        parent.send("stop")
        proc.join(timeout=10)


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}"


def table(results: dict[Placement, Latencies]) -> str:
    rows = ["| server | response | variant | mean µs | p50 µs | p95 µs | stream/unary mean | stream/unary p50 |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for placement, by_size in results.items():
        for size, lat in by_size.items():
            s, u = lat["stream"], lat["unary"]
            ratios = {"stream": f"{s.mean() / u.mean():.2f} | {np.median(s) / np.median(u):.2f}", "unary": " | "}
            for variant, x in lat.items():
                stats = " | ".join(f"{v:.0f}" for v in (x.mean(), *np.percentile(x, [50, 95])))
                rows.append(f"| {placement.value} | {size} B | {variant} | {stats} | {ratios[variant]} |")
    return "\n".join(rows)


def plot(results: dict[Placement, Latencies], title: str, path: Path) -> None:
    groups = [(f"{p.value}\n{size} B response", lat) for p, by_size in results.items() for size, lat in by_size.items()]
    x = np.arange(len(groups))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for offset, variant in ((-0.2, "stream"), (0.2, "unary")):
        means = np.array([lat[variant].mean() for _, lat in groups])  # [groups]
        p95 = np.array([np.percentile(lat[variant], 95) for _, lat in groups])  # [groups]
        ax.bar(x + offset, means, 0.4, yerr=[np.zeros_like(means), p95 - means], capsize=4, label=variant)
    ax.set_xticks(x, [name for name, _ in groups])
    ax.set(ylabel="per-round latency, µs (bar: mean, whisker: p95)", title=title)
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="timed rounds per variant")
    parser.add_argument("--rounds-per-generation", type=int, default=32, help="rounds carried by one stream")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rounds, per_gen = args.rounds, args.rounds_per_generation
    results = {Placement.SEPARATE_PROCESS: run_separate_process(rounds, per_gen),
               Placement.SAME_PROCESS: asyncio.run(run_same_process(rounds, per_gen))}
    header = (f"grpc.aio over 127.0.0.1, {len(make_request(0))}-byte request, {rounds} rounds per variant, "
              f"{per_gen} rounds per stream\n{machine()}")
    markdown = f"# grpc.aio stream vs unary, per-round latency\n\n{header}\n\n{table(results)}\n"
    print(markdown)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "grpc_stream_vs_unary.md").write_text(markdown)
    plot(results, header, args.out_dir / "grpc_stream_vs_unary.png")


if __name__ == "__main__":
    main()
