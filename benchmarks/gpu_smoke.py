"""The GPU check's first step (scripts/gpu_check.sh): in about 20 s, whether this machine can
run the check at all, before anything slow starts.

It prints the versions the check runs on, imports what the server and the tests import (the
generated gRPC stubs, the health service, gguf), then runs a tiny target through the static
engine: a prompt and a tree forward eagerly and replayed from captured graphs (CUDA graphs on
a GPU, their rehearsal on the CPU), which must agree. Any failure ends it with one line naming
what failed and exit 1, and the check stops there.

    python -m benchmarks.gpu_smoke --device cuda
"""
from __future__ import annotations

import argparse
import importlib
import platform
from importlib import metadata
import sys
import tempfile
from pathlib import Path

# module imported -> the distribution whose version is printed
MODULES = {"torch": "torch", "transformers": "transformers", "accelerate": "accelerate",
           "tokenizers": "tokenizers", "safetensors": "safetensors", "numpy": "numpy",
           "onnxruntime": "onnxruntime", "onnx": "onnx", "grpc": "grpcio",
           "google.protobuf": "protobuf", "grpc_health": "grpcio-health-checking",
           "gguf": "gguf", "shared.pb.splitdec.v1.splitdec_pb2_grpc": None}
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}  # graphs replay the eager kernels: near-equal


def versions() -> str:
    """One line: Python and every module the check imports, with its version."""
    found = [f"Python {platform.python_version()}"]
    for name, distribution in MODULES.items():
        importlib.import_module(name)
        if distribution is not None:
            found.append(f"{distribution} {metadata.version(distribution)}")
    import torch

    if torch.cuda.is_available():
        found.append(f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}")
    return ", ".join(found)


def eager_against_graphs(device: str, dtype: str) -> float:
    """The largest logit difference between eager and captured forwards of a tiny target: a
    prompt, then a tree of 8 nodes after it."""
    import torch

    from cloud_server.calibrate import bushy_tree
    from cloud_server.engine.cuda_graphs import Rehearsal, Replay
    from cloud_server.engine.static_engine import SlotPlan, StaticEngine
    from cloud_server.target import TargetModel
    from testkit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        base = TargetModel.load(str(build_tiny_model(Path(tmp))), "tiny", device,
                                precision=dtype, engine="transformers", onednn=False)
    plan = SlotPlan(sessions=2, positions=128, most_tree_nodes=8)
    graphs = Replay if base.device.type == "cuda" else Rehearsal
    logits = []
    for kind in (None, graphs):
        engine = StaticEngine(base.model, base.device, plan, kind)
        engine.prepare([()], sessions=1)
        target = TargetModel(base.model, base.tokenizer, "tiny", base.device, engine)
        cache, first = target.prefill(list(range(5, 45)))
        tree = target.forward_tree(cache, int(first.argmax()), bushy_tree(8, 300))
        logits.append(torch.cat([first[None], tree]).float().cpu())
    return float((logits[0] - logits[1]).abs().max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--versions", action="store_true", help="print the versions line only")
    args = p.parse_args(argv)
    try:
        print(f"gpu_smoke: {versions()}", flush=True)
        if args.versions:
            return 0
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        gap = eager_against_graphs(args.device, args.dtype)
    except Exception as err:  # the check stops on any of them, with its line
        print(f"gpu_smoke: FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    limit = TOLERANCE[args.dtype]
    verdict = "ok" if gap <= limit else "FAILED"
    print(f"gpu_smoke: {verdict}: eager against captured forwards on {args.device} in "
          f"{args.dtype}, largest logit difference {gap:.2e} (at most {limit:g})", flush=True)
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
