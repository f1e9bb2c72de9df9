"""Serves the GPU-paced stand-in (testkit/paced_target.py) as cloud-server serves a target:
the product's service, batcher and sessions around an engine that costs the host nothing and
holds a fixed time a forward. A benchmark's server (benchmarks/host_overhead.py --paced-ms),
not a cloud-server option: the stand-in answers by a rule, not a model.

    python -m benchmarks.paced_server --model DIR --paced-ms 1.5   # prints `listening on`
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cloud_server.config import ServerConfig
from cloud_server.model_thread import ModelThread
from cloud_server.rpc.relay import EngineRelay
from cloud_server.rpc.server import build_service, serve
from cloud_server.rpc.service import SplitDecodingService
from shared import gc_freeze
from shared.messages import Limits
from shared.signals import stop_requested
from testkit.paced_target import paced_target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a checkpoint directory: its "
                   "config and tokenizer (its weights are loaded, never run)")
    p.add_argument("--paced-ms", type=float, required=True, help="a forward's hold")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-sessions", type=int, default=16)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--frontends", type=int, default=0, help="as cloud-server's")
    p.add_argument("--engine-socket", metavar="PATH",
                   help="serve no gRPC: only the engine's side of the front ends' frames, on "
                        "this Unix socket (benchmarks/engine_capacity.py speaks them)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Serves the stand-in as cloud-server serves a target, with the defaults but two: no
    trained drafter, and a forward may carry every session's largest tree (a GPU's forward
    costs the same whatever it carries, so none is cut in two)."""
    args = parse_args(argv)
    limits = Limits(max_sessions=args.max_sessions)
    rows = args.max_sessions * (1 + limits.max_tree_nodes)
    model_thread = ModelThread()
    target = model_thread.call(paced_target, args.model, args.paced_ms / 1000, rows)
    service = build_service(target, ServerConfig(limits, batch_tokens=rows), model_thread)
    print(f"loaded {target.model_id}: {target.engine.describe()}", file=sys.stderr, flush=True)
    if args.metrics_port is not None:
        service.metrics.serve(args.host, args.metrics_port)
    if args.engine_socket:
        asyncio.run(serve_engine(service, args.engine_socket))
    else:
        asyncio.run(serve(service, args.host, args.port, frontends=args.frontends))
    return 0


async def serve_engine(service: SplitDecodingService, path: str) -> None:
    """The engine's process as `--frontends` runs it, its front ends left to the caller:
    the relay on `path` until SIGTERM."""
    stopping = stop_requested()
    relay = EngineRelay(service)
    await relay.listen(path)
    gc_freeze.freeze_loaded()
    service.start_reaper()
    print(f"listening on unix:{path}", flush=True)
    await stopping.wait()
    await relay.close()
    service.shutdown()


if __name__ == "__main__":
    sys.exit(main())
