"""The server's CPU per message exchange, by transport, with nothing else in the server: the
floor under any host path that keeps one stream per session in one Python process.

A split session-forward takes at least one client message in and one Verdict out. Here an echo
server does exactly that and nothing more, on one core, for S concurrent lock-step streams
driven from another core, and its CPU time (from /proc) is divided by the exchanges it served.
Transports: grpc.aio as the product's service uses it (`context.read()` and an awaited
`context.write()` a message; bare, with the idle timeout as `asyncio.wait_for` around the read,
which starts a task a read, and as an `asyncio.timeout` block, which does not), and length-prefixed frames over a Unix socket on asyncio: the compact wire a gRPC
front-end process would speak to an engine process (vLLM V1's layout, issue 63).

    python -m benchmarks.wire_floor --streams 1,16,64 --server-cores 0 --client-cores 1
"""
from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable

import grpc

from benchmarks.common import (
    RESULTS, add_placement_args, grouped_bars, machine, markdown_table, parse_cores, placement,
    python_module, write_results,
)

SERVICE = "bench.Floor"
REQUEST = bytes(300)  # a 32-node draft's size on the wire
RESPONSE = bytes(100)  # a Verdict without activation rows
IDLE_S = 300.0
FRAME = struct.Struct("<I")
TRANSPORTS = ("grpc", "grpc-wait-for", "grpc-timeout", "unix-frames")


def _identity(message: bytes) -> bytes:
    return message


async def _echo(_: object, context: grpc.aio.ServicerContext) -> None:
    while await context.read() is not grpc.aio.EOF:
        await context.write(RESPONSE)


async def _echo_wait_for(_: object, context: grpc.aio.ServicerContext) -> None:
    while await asyncio.wait_for(context.read(), IDLE_S) is not grpc.aio.EOF:
        await context.write(RESPONSE)


async def _echo_timeout(_: object, context: grpc.aio.ServicerContext) -> None:
    while True:
        async with asyncio.timeout(IDLE_S):
            if await context.read() is grpc.aio.EOF:
                return
        await context.write(RESPONSE)


HANDLERS = {"grpc": _echo, "grpc-wait-for": _echo_wait_for, "grpc-timeout": _echo_timeout}


async def _serve_grpc(transport: str) -> None:
    server = grpc.aio.server()
    handler = HANDLERS[transport]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.stream_stream_rpc_method_handler(handler, _identity, _identity)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def _frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while header := await reader.readexactly(FRAME.size):
        await reader.readexactly(FRAME.unpack(header)[0])
        writer.write(FRAME.pack(len(RESPONSE)) + RESPONSE)
        await writer.drain()


async def _serve_frames(path: str) -> None:
    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _frames(reader, writer)
        except asyncio.IncompleteReadError:
            writer.close()
    server = await asyncio.start_unix_server(one, path)
    print(f"listening on {path}", flush=True)
    await server.serve_forever()


Timed = tuple[float, float, float]  # wall, server CPU and this process's CPU seconds


async def _timed(pid: int, streams: list[Awaitable[None]]) -> Timed:
    """Runs the streams together; what it took in wall time and CPU, both sides."""
    cpu, mine, start = _cpu_s(pid), time.process_time(), time.perf_counter()
    await asyncio.gather(*streams)
    return (time.perf_counter() - start, _cpu_s(pid) - cpu, time.process_time() - mine)


async def _grpc_streams(address: str, pid: int, streams: int, rounds: int) -> Timed:
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.stream_stream(f"/{SERVICE}/Echo", _identity, _identity)

        async def stream() -> None:
            call = method(timeout=600)
            for _ in range(rounds):
                await call.write(REQUEST)
                await call.read()
            await call.done_writing()
        return await _timed(pid, [stream() for _ in range(streams)])


async def _frame_streams(path: str, pid: int, streams: int, rounds: int) -> Timed:
    async def stream() -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        for _ in range(rounds):
            writer.write(FRAME.pack(len(REQUEST)) + REQUEST)
            await reader.readexactly(FRAME.unpack(await reader.readexactly(FRAME.size))[0])
        writer.close()
    return await _timed(pid, [stream() for _ in range(streams)])


def _cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far, all its threads (proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(transport: str, streams: int, exchanges: int, cores: frozenset[int] | None
            ) -> dict[str, float]:
    """One server process, `streams` concurrent lock-step streams, `exchanges` in all."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "floor.sock")
        args = ["--serve", transport] + (["--socket", path] if transport == "unix-frames" else [])
        proc = python_module("benchmarks.wire_floor", args, cores, stdout=subprocess.PIPE,
                              text=True)
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().strip().removeprefix("listening on ")
            rounds = max(1, exchanges // streams)
            drive = _frame_streams if transport == "unix-frames" else _grpc_streams
            asyncio.run(drive(address, proc.pid, 1, 200))  # first calls, outside the count
            wall, server_s, client_s = asyncio.run(drive(address, proc.pid, streams, rounds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    done = streams * rounds
    return {"server_us": 1e6 * server_s / done, "client_us": 1e6 * client_s / done,
            "per_s": done / wall, "server_load": server_s / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--exchanges", type=int, default=20000, help="message exchanges a cell")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--name", default="wire_floor")
    p.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    add_placement_args(p)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve_frames(args.socket) if args.serve == "unix-frames"
                    else _serve_grpc(args.serve))
        return
    if client_cores := parse_cores(args.client_cores):
        os.sched_setaffinity(0, client_cores)
    counts, transports = [int(s) for s in args.streams.split(",")], args.transports.split(",")
    rows: list[tuple[object, ...]] = []
    series: dict[str, list[float]] = {t: [] for t in transports}
    for streams in counts:
        for transport in transports:
            cell = measure(transport, streams, args.exchanges, parse_cores(args.server_cores))
            print(transport, streams, cell, file=sys.stderr, flush=True)
            series[transport].append(cell["server_us"])
            rows.append((transport, streams, f"{cell['server_us']:.1f}",
                         f"{cell['client_us']:.1f}", f"{cell['per_s']:.0f}",
                         f"{cell['server_load']:.2f}"))
    header = (f"# The server's CPU per message exchange\n\n{machine()}; {placement(args)}; "
              f"{args.exchanges} exchanges a cell, request {len(REQUEST)} B, response "
              f"{len(RESPONSE)} B; grpcio {grpc.__version__}\n\n")
    write_results(args.name, header + markdown_table(
        ("transport", "streams", "server CPU µs/exchange", "clients CPU µs/exchange",
         "exchanges/s", "server CPU s/s"), rows) + "\n")
    grouped_bars(RESULTS / f"{args.name}.png", [f"{s} streams" for s in counts], series,
                 "server CPU µs per exchange", "One message in, one out: the server's CPU")


if __name__ == "__main__":
    main()
