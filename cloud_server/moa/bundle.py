"""The drafter bundle the server offers to edges: ONNX graphs (fp32 and int8) + config + tokenizer.

A directory `moa-<model id>-<sha256[:12]>/` holding
    bundle.json        format, model id, MoaConfig, top_k, and each file's sha256 and role
    memory.onnx, step.onnx            fp32 (export.py)
    memory.int8.onnx, step.int8.onnx  dynamic int8 (onnxruntime.quantization)
    tokenizer.json                    the target's tokenizer, when given
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
from cloud_server.moa.weights import load_drafter
from shared import progress
from shared.drafter_bundle import (
    CHOICES_FILE, GRAPH_FILES, MANIFEST_NAME, TOKENIZER_NAME, BundleManifest, Graph, Precision,
)

FP32, INT8 = GRAPH_FILES[Precision.FP32], GRAPH_FILES[Precision.INT8]


def build_bundle(drafter_dir: Path, target: torch.nn.Module, model_id: str, out_root: Path,
                 tokenizer_json: bytes | None = None, top_k: int = TOP_K,
                 precisions: tuple[Precision, ...] = tuple(Precision)) -> Path:
    """Exports, quantizes and writes the bundle under `out_root`; returns its directory (reused
    when a bundle with the same content exists). For SmolLM2 the fp32 graphs are ~150 MB (the
    embedding table dominates) and the int8 ones ~40 MB: offer only int8 to edges."""
    if not precisions:
        raise ValueError("a bundle needs at least one precision")
    config, server, edge = load_drafter(drafter_dir, target)
    out_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_root, prefix=".building-"))
    try:
        quantized = Precision.INT8 in precisions
        with progress.bar(1 + quantized * len(Graph), "drafter bundle", unit="step") as shown:
            export_edge(edge, staging, top_k, server)
            shown.update()
            for graph in Graph:
                if quantized:
                    quantize_int8(staging / FP32[graph], staging / INT8[graph])
                    shown.update()
                if Precision.FP32 not in precisions:
                    (staging / FP32[graph]).unlink()
        if tokenizer_json is not None:
            (staging / TOKENIZER_NAME).write_bytes(tokenizer_json)
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
