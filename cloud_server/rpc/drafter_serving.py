"""Serving a MoA drafter: its server half computes activations, its edge half goes out as a
bundle artifact (docs/architecture.md, Drafters).

The bundle (ONNX export + mixed-precision weights of the edge half with the target's embedding and
head, and the drafter's designed tree if it has one) is built once per trained drafter and
cached under the cache root, keyed by the sha256 of the drafter's files and the model id, so a
restart serves the same bytes at once.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from cloud_server.engine.modules_parallel import ModulesParallelEngine
from cloud_server.moa.activations import ServerActivations
from cloud_server.moa.bundle import archive, build_bundle
from cloud_server.moa.config import MoaConfig
from cloud_server.moa.weights import CONFIG, WEIGHTS, committed_drafter
from cloud_server.target import TargetModel
from shared.cache import cache_root
from shared.drafter_bundle import CHOICES_FILE, MANIFEST_NAME, BundleManifest, Precision

PRECISIONS = (Precision.MIXED,)  # what the edge runs; int8 would double the fetch (LOG bundle_mixed)
EXPORT_REVISION = 4  # raise when export.py changes what it writes: cached bundles are rebuilt


@dataclass
class ServedDrafter:
    activations: ServerActivations | None  # None: the drafter reads none (Independent baseline)
    width: int  # of the activations; 0 when it reads none
    bundle: bytes  # the archive FetchArtifact streams
    artifact: str  # the name Info lists it under (MOA_ARTIFACT or FALCON_ARTIFACT)


def find_drafter(choice: str, model_id: str) -> Path | None:
    """`--drafter-dir`: 'default' is the MoA drafter committed for the model (if any),
    'falcon' the Falcon drafter committed for it, 'none' none, anything else a directory
    holding moa.safetensors and moa_config.json."""
    if choice == "none":
        return None
    if choice in ("default", "falcon"):
        found = committed_drafter(model_id, falcon=choice == "falcon")
        if found is None and choice == "falcon":
            raise FileNotFoundError(f"no Falcon drafter is committed for {model_id}: train one "
                                    "with `cloud-server train-drafter --method falcon`")
        return found
    path = Path(choice)
    if not (path / WEIGHTS).is_file() or not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{path} holds no trained drafter ({WEIGHTS}, {CONFIG})")
    return path


def serve_drafter(drafter_dir: Path, target: TargetModel) -> ServedDrafter:
    """Loads the server half (if the drafter has one) and the (cached) bundle; run it on the
    model thread."""
    config = MoaConfig.load(drafter_dir / CONFIG)
    activations = (ServerActivations.load(drafter_dir, target.model)
                   if config.uses_activations else None)
    if (activations is not None and not activations.hidden_layers
            and isinstance(target.engine, ModulesParallelEngine)):
        raise ValueError("this drafter reads the cache's K/V, which transformers' tensor-"
                         "parallel plan leaves split over the ranks: serve it without "
                         "--tensor-parallel, with --engine static, or train one that reads "
                         "layer outputs")
    key = f"{target.model_id}/{','.join(p.value for p in PRECISIONS)}/{EXPORT_REVISION}"
    digest = hashlib.sha256(key.encode())
    for name in (WEIGHTS, CONFIG, CHOICES_FILE):  # a design added later makes a new bundle
        if (drafter_dir / name).is_file():
            digest.update((drafter_dir / name).read_bytes())
    root = cache_root() / "bundles" / digest.hexdigest()[:24]
    built = sorted(root.glob("moa-*")) if root.is_dir() else []
    if not built:
        print("building the drafter bundle (ONNX export, mixed precision) ...", file=sys.stderr, flush=True)
        built = [build_bundle(drafter_dir, target.model, target.model_id, root,
                              precisions=PRECISIONS)]
    manifest = BundleManifest.from_json((built[0] / MANIFEST_NAME).read_text())
    return ServedDrafter(activations, config.width if activations else 0, archive(built[0]),
                         manifest.artifact)
