"""The drafter bundle the server offers to edges: ONNX graphs (fp32, int8, mixed) + config.

A directory `moa-<model id>-<sha256[:12]>/` holding, of the precisions asked for,
    bundle.json        format, model id, MoaConfig, top_k, and each file's sha256 and role
    memory.onnx, step.onnx            fp32 (export.py)
    memory.int8.onnx, step.int8.onnx  dynamic int8 (onnxruntime.quantization)
    memory.mixed.onnx, step.mixed.onnx  int8, and 2 bits for rarely read rows (quantize_mixed.py)
    tree_choices.json                 the drafter's designed tree, when it has one
The name's hash is the sha256 of bundle.json, which lists every file's sha256, so one hash
names the whole bundle. `archive` packs it as a deterministic tar (the bytes a fetch sends and
the sha256 an Info lists); edge_client/drafters/moa_bundle.py unpacks and checks it.
Built by the server from the committed trained part plus the target's shared weights.
"""
from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from cloud_server.moa.export import TOP_K, export_edge, quantize_int8
from cloud_server.moa.model import EdgeHalf
from cloud_server.moa.quantize_mixed import quantize_mixed
from cloud_server.moa.weights import load_drafter
from shared import progress
from shared.drafter_bundle import (
    CHOICES_FILE, GRAPH_FILES, MANIFEST_NAME, BundleManifest, Graph, Precision,
)

FP32 = GRAPH_FILES[Precision.FP32]


def build_bundle(drafter_dir: Path, target: torch.nn.Module, model_id: str, out_root: Path,
                 top_k: int = TOP_K,
                 precisions: tuple[Precision, ...] = tuple(Precision)) -> Path:
    """Exports, quantizes and writes the bundle under `out_root`; returns its directory (reused
    when a bundle with the same content exists). Sizes for SmolLM2: LOG bundle_mixed."""
    if not precisions:
        raise ValueError("a bundle needs at least one precision")
    config, server, edge = load_drafter(drafter_dir, target)
    out_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_root, prefix=".building-"))
    quantized = [p for p in precisions if p is not Precision.FP32]
    try:
        with progress.bar(1 + len(quantized) * len(Graph), "drafter bundle",
                          unit="step") as shown:
            export_edge(edge, staging, top_k, server)
            shown.update()
            for graph in Graph:
                for precision in quantized:
                    _quantize(precision, edge, staging / FP32[graph],
                              staging / GRAPH_FILES[precision][graph])
                    shown.update()
                if Precision.FP32 not in precisions:
                    (staging / FP32[graph]).unlink()
        if (drafter_dir / CHOICES_FILE).is_file():  # benchmarks/tree_design.py wrote it
            shutil.copyfile(drafter_dir / CHOICES_FILE, staging / CHOICES_FILE)
        files = {p.name: _sha256(p.read_bytes()) for p in sorted(staging.iterdir())}
        manifest = BundleManifest(model_id, top_k, config.to_dict(), files,
                                  {p: GRAPH_FILES[p] for p in Precision if p in precisions})
        text = manifest.to_json()
        (staging / MANIFEST_NAME).write_text(text)
        final = out_root / f"moa-{_safe(model_id)}-{_sha256(text.encode())[:12]}"
        if final.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(final)
        return final
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _quantize(precision: Precision, edge: EdgeHalf, source: Path, dest: Path) -> None:
    if precision is Precision.INT8:
        quantize_int8(source, dest)
    else:
        rows = edge.vocab_ids.cpu()
        tied = torch.equal(edge.head.float().cpu(), edge.embedding.float().cpu()[rows])
        quantize_mixed(source, dest, rows.numpy(), tied)


def archive(bundle_dir: Path) -> bytes:
    """A deterministic uncompressed tar of the bundle (ONNX weights barely compress)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(bundle_dir.iterdir()):
            info = tarfile.TarInfo(f"{bundle_dir.name}/{path.name}")
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
