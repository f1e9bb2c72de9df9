"""Builds and runs the grpc.aio server: the service, the health service, graceful stop."""
from __future__ import annotations

import asyncio
import sys
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cloud_server.rpc.artifacts import ArtifactStore
from cloud_server.calibrate import measure_verify_costs
from cloud_server.config import ServerConfig
from cloud_server.rpc.frontend import GRACE_S, server_options
from cloud_server.rpc.frontend_processes import FrontEnds, socket_path
from cloud_server.rpc.health_check import SERVICE_NAME
from cloud_server.rpc.relay import EngineRelay
from cloud_server.rpc.drafter_serving import serve_drafter
from cloud_server.model_thread import ModelThread
from cloud_server.rpc.security import Security
from cloud_server.rpc.service import SplitDecodingService
from cloud_server.target import TargetModel
from shared import gc_freeze
from shared.signals import stop_requested
from shared.messages import TOKENIZER_ARTIFACT, ArtifactKind
from shared.pb.splitdec.v1 import splitdec_pb2_grpc


def build_service(target: TargetModel, config: ServerConfig,
                  model_thread: ModelThread | None = None) -> SplitDecodingService:
    """Loads the MoA drafter when there is one, lets the engine prepare the forwards it will
    run (the static engine's graphs), measures the verify costs Info reports, then builds the
    service. `model_thread` should be the thread that loaded `target` (see
    model_thread.py)."""
    model_thread = model_thread or ModelThread()
    artifacts = ArtifactStore()
    artifacts.add(TOKENIZER_ARTIFACT, ArtifactKind.TOKENIZER, target.tokenizer_json())
    drafter = None
    captures: list[tuple[int, ...]] = [()]
    if config.drafter_dir is not None:
        drafter = model_thread.call(serve_drafter, config.drafter_dir, target)
        artifacts.add(drafter.artifact, ArtifactKind.DRAFTER_BUNDLE, drafter.bundle)
        print(f"{drafter.artifact} bundle: {len(drafter.bundle) / 1e6:.1f} MB, activations of width "
              f"{drafter.width}", file=sys.stderr, flush=True)
        if drafter.activations is not None and drafter.activations.hidden_layers:
            captures.append(drafter.activations.hidden_layers)
    batches = config.batch_tokens and config.graphs_at_start
    model_thread.call(target.engine.prepare, captures,
                      config.limits.max_sessions if batches else 1)
    costs = model_thread.call(measure_verify_costs, target, config.limits.max_tree_nodes)
    print("verify cost: " + ", ".join(f"{n} nodes {ms:.0f} ms" for n, ms in costs),
          file=sys.stderr, flush=True)
    if config.batch_tokens and not target.batchable:
        print(f"{target.model_id} cannot batch sessions (its attention does not go through "
              "transformers' attention interface): one session per forward", file=sys.stderr,
              flush=True)
    return SplitDecodingService(target, model_thread, config, artifacts, costs, drafter)


async def start(service: SplitDecodingService, host: str, port: int,
                security: Security = Security()
                ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts serving (over TLS when `security` has a certificate); returns the server, the
    bound port and the health servicer."""
    server = grpc.aio.server(options=server_options(service.config.limits.max_message_bytes),
                             interceptors=security.interceptors())
    splitdec_pb2_grpc.add_SplitDecodingServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = security.credentials()
    bound = (server.add_insecure_port(f"{host}:{port}") if credentials is None
             else server.add_secure_port(f"{host}:{port}", credentials))
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    gc_freeze.freeze_loaded()  # the model and drafter are loaded: no pass walks them again
    await server.start()
    service.start_reaper()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


async def start_relayed(service: SplitDecodingService, host: str, port: int,
                        security: Security, frontends: int,
                        on_failure: Callable[[str], None]) -> tuple[EngineRelay, FrontEnds, int]:
    """Starts serving through `frontends` gRPC front-end processes (frontend.py) relaying to
    this process's engine (relay.py); returns the relay, the front ends and the bound port.
    `on_failure` hears of a front end that died and could not be replaced."""
    relay = EngineRelay(service)
    path = socket_path()
    await relay.listen(path)
    gc_freeze.freeze_loaded()
    front_ends = FrontEnds(frontends, path, host, port, service.config.limits.max_message_bytes,
                           security, on_failure)
    try:
        bound = await front_ends.start()
    except OSError:
        await front_ends.stop()
        await relay.close()
        raise
    service.start_reaper()
    return relay, front_ends, bound


async def serve(service: SplitDecodingService, host: str, port: int,
                security: Security = Security(),
                stop_on: Callable[[Callable[[], object]], None] = lambda stop: None,
                frontends: int = 0) -> None:
    """Serves until SIGTERM or SIGINT, or until what `stop_on` is handed is called (from any
    thread: a tensor-parallel target's lost rank), then stops taking work and drains for
    GRACE_S. With `frontends`, gRPC runs in that many processes of its own (start_relayed);
    RuntimeError when one died and could not be replaced."""
    stopping = stop_requested()
    loop = asyncio.get_running_loop()
    stop = lambda: loop.call_soon_threadsafe(stopping.set)  # noqa: E731
    stop_on(stop)
    failures: list[str] = []

    def failed(why: str) -> None:
        failures.append(why)
        stop()

    if frontends:
        relay, front_ends, bound = await start_relayed(service, host, port, security,
                                                       frontends, failed)
    else:
        server, bound, health_servicer = await start(service, host, port, security)
    print(f"listening on {host}:{bound}", flush=True)
    await stopping.wait()
    print("stopping: draining sessions", file=sys.stderr, flush=True)
    if frontends:
        await front_ends.stop()
        await relay.close()
    else:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(GRACE_S)
    service.shutdown()
    if failures:
        raise RuntimeError(failures[0])
