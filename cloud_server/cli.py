"""`cloud-server`: loads the target model and serves split decoding over gRPC.

`cloud-server train-drafter ...` trains the MoA drafter instead (cloud_server/training/cli.py);
`cloud-server health ...` asks a running server whether it serves (cloud_server/rpc/health_check.py).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Callable

from cloud_server.decoding.batching import DEFAULT_MAX_TOKENS
from cloud_server.config import PacingPolicy, ServerConfig
from shared.drafting import SERVER_DRAFTERS
from cloud_server.device import Device, EngineChoice, Graphs, Precision, Weights
from shared import progress
from shared.drafting.base import DrafterName
from shared.errors import SplitDecodingError
from shared.messages import Limits, Pace

# What the `cloud` extra installs (pyproject.toml): an edge-only install has none of these.
CLOUD_EXTRA_MODULES = frozenset({"torch", "transformers", "accelerate", "gguf", "grpc_health",
                                 "onnx", "safetensors", "prometheus_client"})

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = Limits()
    p = argparse.ArgumentParser(prog="cloud-server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct, embedded), a hub id or a local path")
    p.add_argument("--device", choices=[d.value for d in Device], default=Device.AUTO.value)
    p.add_argument("--dtype", choices=[d.value for d in Precision], default=Precision.AUTO.value,
                   help="the target's precision; auto (default): bf16 on a GPU, on the CPU the "
                        "checkpoint's bf16, else fp32. Greedy output equals the same server's "
                        "plain decoding token for token, but for near-ties, which in bf16 or "
                        "fp16 can break the other way between a tree forward and a decoding "
                        "step (docs/usage.md, --dtype)")
    p.add_argument("--cpu-linear", choices=("onednn", "stock"), default="onednn",
                   help="CPU linear kernels for --weights fp32: oneDNN (about 2x faster here) "
                        "or PyTorch's default")
    p.add_argument("--weights", choices=[w.value for w in Weights], default=Weights.AUTO.value,
                   help="q4: the GGUF's 4-bit blocks (or the checkpoint rounded to 4 bits) in one "
                        "onnxruntime graph, on the CPU, for Llama-shaped models; fp32: the "
                        "weights unquantized, in --dtype, run by --engine; auto (default): q4 "
                        "for a model from a 4-bit GGUF (the embedded default) where it runs, "
                        "else fp32: a checkpoint of yours keeps its precision. Split output "
                        "equals the same server's plain output either way")
    p.add_argument("--engine", choices=[e.value for e in EngineChoice],
                   default=EngineChoice.AUTO.value,
                   help="what runs --weights fp32: static (static shapes over preallocated KV "
                        "slots; Llama, Qwen2, Qwen3, Mistral), transformers (its modules, "
                        "eager, any causal LM); auto (default): static on a GPU where it runs "
                        "the model, else transformers")
    p.add_argument("--cuda-graphs", choices=[g.value for g in Graphs], default=Graphs.AUTO.value,
                   help="the static engine replays each forward shape from a CUDA graph "
                        "captured at startup; auto (default): on when the target is on CUDA; "
                        "rehearse: the engine a GPU picks, padded to the same shapes, each "
                        "run eagerly under the graphs' contract (a GPU's forwards on a CPU)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N ranks (processes: one a GPU on CUDA, a share "
                        "of the cores on the CPU) as Megatron-LM does, on the static engine; "
                        "this process is rank 0 and serves. N must divide the model's "
                        "attention and KV heads (docs/usage.md, --tensor-parallel); default 1")
    p.add_argument("--frontends", type=int, default=0, metavar="N",
                   help="serve gRPC from N processes of its own, relaying to the engine over "
                        "a Unix socket, so gRPC's CPU is not the engine core's (0: in the "
                        "engine's process; docs/usage.md, --frontends)")
    p.add_argument("--max-sessions", type=int, default=defaults.max_sessions)
    p.add_argument("--max-tree-nodes", type=int, default=defaults.max_tree_nodes)
    p.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--kv-budget-mb", type=int, default=0, metavar="MB",
                   help="KV cache all sessions may hold together, each counted at the most it "
                        "can grow to (prompt + new tokens + a tree); past it a new session is "
                        "refused RESOURCE_EXHAUSTED. 0 (default): only --max-sessions limits")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="the most new tokens one forward pass runs for the sessions ready "
                        "together (batched verification); 0: one session per forward "
                        "(default %(default)s)")
    p.add_argument("--batch-graphs", choices=("first-use", "start"), default="first-use",
                   help="--weights q4: build the graph for each batch size (up to "
                        "--max-sessions a forward) at startup, or when a batch first needs "
                        "it (default), which stalls every session for its build: seconds "
                        "for 2 sessions, tens for 8; the static engine's CUDA graphs for "
                        "batches of several sessions likewise (docs/usage.md, --batch-graphs)")
    p.add_argument("--idle-timeout", type=int, default=defaults.session_idle_timeout_s,
                   help="seconds a session may stay silent before it is closed")
    p.add_argument("--drafter-dir", default="default", metavar="DIR",
                   help="the trained drafter to serve: 'default' (the MoA drafter committed for "
                        "the model, if any), 'falcon' (the Falcon drafter committed for it), "
                        "'none', or a directory from `cloud-server train-drafter` "
                        "(its independent/ serves the Independent baseline, which needs no "
                        "activations)")
    pacing = PacingPolicy()
    p.add_argument("--pace", choices=[m.value for m in Pace], default=pacing.pace.value,
                   help="pace for sessions whose client names none (edge-client sends its "
                        "own, auto by default); default %(default)s")
    p.add_argument("--lead", type=int, default=pacing.lead, metavar="N",
                   help="paced sessions: tokens the server may run past what the client "
                        "acknowledged when it names no lead (default %(default)s)")
    p.add_argument("--max-lead", type=int, default=pacing.max_lead, metavar="N",
                   help="the most lead a client may ask for (default %(default)s)")
    p.add_argument("--own-drafter", choices=(*SERVER_DRAFTERS, "none"), default=pacing.drafter,
                   help="the drafter the server runs for its own candidates in paced "
                        "sessions (default %(default)s)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS only, with this certificate "
                   "chain (and --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    p.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: accept only clients with a certificate this CA signed; a "
                        "session can then be resumed only with the certificate that opened it")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help="every call but the health service's must carry this token "
                        "(edge-client --auth-token-file)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free "
                        "port); off by default")
    p.add_argument("--no-load-wait", action="store_true",
                   help="auto pace: do not wait longer for client drafts while other sessions "
                        "have work queued (docs/usage.md, Pacing)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (the GGUF conversion, the bundle build); a pipe "
                        "gets none either")
    args = p.parse_args(argv)
    if not 1 <= args.lead <= args.max_lead:
        p.error(f"--lead must be between 1 and --max-lead ({args.max_lead})")
    if args.batch_tokens < 0:
        p.error("--batch-tokens must be 0 (no batching) or more")
    if args.tensor_parallel < 1:
        p.error("--tensor-parallel must be 1 or more")
    if args.frontends < 0:
        p.error("--frontends must be 0 (gRPC in the engine's process) or more")
    return args


def pacing_from(args: argparse.Namespace) -> PacingPolicy:
    return PacingPolicy(Pace(args.pace), args.lead, args.max_lead,
                        None if args.own_drafter == "none" else DrafterName(args.own_drafter),
                        load_wait=not args.no_load_wait)


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(max_tree_nodes=args.max_tree_nodes, max_prompt_tokens=args.max_prompt_tokens,
                  max_new_tokens=args.max_new_tokens, max_sessions=args.max_sessions,
                  session_idle_timeout_s=args.idle_timeout)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in CLOUD_EXTRA_MODULES:
            raise
        print(f"cloud-server: error: no module '{err.name}': the server needs the cloud "
              f"extra: pip install 'splitdec[cloud]' (docs/usage.md, Installing one side)",
              file=sys.stderr)
        return 1


def run(argv: list[str]) -> int:
    if argv[:1] == ["train-drafter"]:
        from cloud_server.training.cli import main as train_drafter

        return train_drafter(argv[1:])
    if argv[:1] == ["health"]:
        from cloud_server.rpc.health_check import main as health

        return health(argv[1:])
    args = parse_args(argv)
    if args.quiet:
        progress.set_quiet()
    lost_rank = LostRank()
    try:
        from cloud_server import model_store
        from cloud_server.model_thread import ModelThread
        from cloud_server.rpc.security import Security
        from cloud_server.rpc.server import build_service, serve
        from cloud_server.target import TargetModel

        from cloud_server.rpc.drafter_serving import find_drafter

        model_store.follow_progress_setting()
        security = Security.from_files(args.tls_cert, args.tls_key, args.auth_token_file,
                                       args.tls_client_ca)
        path, model_id = model_store.resolve(args.model)
        if args.tensor_parallel > 1:
            from cloud_server.target import ranks_unfit

            unfit = ranks_unfit(path, args.tensor_parallel, Device(args.device))
            if unfit is not None:
                print(f"cloud-server: error: {model_id}: {unfit}", file=sys.stderr)
                return 2
        drafter_dir = find_drafter(args.drafter_dir, model_id)
        print(f"loading {model_id} ...", file=sys.stderr, flush=True)
        model_thread = ModelThread()
        target = model_thread.call(TargetModel.load, path, model_id, Device(args.device),
                                   args.cpu_linear == "onednn", Precision(args.dtype),
                                   Weights(args.weights), model_store.gguf_of(args.model),
                                   EngineChoice(args.engine), Graphs(args.cuda_graphs),
                                   limits_from(args), args.tensor_parallel, lost_rank.lost)
        config = ServerConfig(limits_from(args), drafter_dir, pacing_from(args),
                              args.kv_budget_mb * 2**20, args.batch_tokens,
                              args.batch_graphs == "start")
        service = build_service(target, config, model_thread)
        print(f"loaded {model_id} on {target.device}: {target.engine.describe()}",
              file=sys.stderr, flush=True)
        if str(target.model.dtype) != "torch.float32":
            print(f"{target.model.dtype}: greedy output is plain decoding's up to near-ties "
                  "(docs/usage.md, --dtype; --dtype fp32 for the fp32 output)",
                  file=sys.stderr, flush=True)
        if args.metrics_port is not None:
            bound = service.metrics.serve(args.host, args.metrics_port)
            print(f"metrics on http://{args.host}:{bound}/metrics", file=sys.stderr, flush=True)
        asyncio.run(serve(service, args.host, args.port, security, lost_rank.stop_with,
                          args.frontends))
    except (OSError, RuntimeError, ValueError, SplitDecodingError) as err:
        print(f"cloud-server: error: {err}", file=sys.stderr)
        return 1
    if lost_rank.why is not None:
        print(f"cloud-server: error: {lost_rank.why}", file=sys.stderr)
        return 1
    return 0


class LostRank:
    """A tensor-parallel target's lost rank (engine/ranks.py) stops the server as SIGTERM
    does, once it serves (before, the startup's forwards fail with it), and makes it exit 1
    naming the rank: every session's next forward meanwhile ends it UNAVAILABLE."""

    def __init__(self) -> None:
        self.why: str | None = None
        self._stop: Callable[[], object] | None = None
        self._lock = threading.Lock()

    def lost(self, why: str) -> None:
        """Told by the ranks' watcher or the model thread."""
        with self._lock:
            self.why, stop = why, self._stop
        if stop is not None:
            stop()

    def stop_with(self, stop: Callable[[], object]) -> None:
        """Handed the server's stop once it serves."""
        with self._lock:
            self._stop, why = stop, self.why
        if why is not None:
            stop()


if __name__ == "__main__":
    sys.exit(main())
