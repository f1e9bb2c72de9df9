"""A random-weight checkpoint of a target's exact shape, for timing a GPU node where the
target's weights cannot come (scripts/gpu_check.sh's first phase): a forward's time depends on
the shapes, not on the weights.

The weights are seeded and sharpened (testkit/tiny_model.py) so that the next-token
distributions are peaked: greedy answers then agree across methods and batch shapes in fp32, as
the capacity benchmark requires, and its oracle drafter (testkit/profile_oracle.py) stands in
for a drafter trained on the target. SHAPE_DIR holds the target's config.json and tokenizer
files and nothing else is read (scripts/gpu_kit.sh copies the default's).

    python -m benchmarks.random_target SHAPE_DIR OUT_DIR
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from testkit.tiny_model import sharpen

SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_shape(checkpoint: Path, out: Path) -> None:
    """The files of `checkpoint` that give its shape and tokenizer, without its weights."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SHAPE_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, out / name)


def build(shape_dir: Path, out: Path, seed: int = 0) -> Path:
    """Writes the random checkpoint (fp32 safetensors) and the tokenizer to `out`."""
    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    copy_shape(shape_dir, out)
    sharpen(model).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not (args.shape_dir / "config.json").is_file():
        print(f"random_target: {args.shape_dir} holds no config.json", file=sys.stderr)
        return 2
    build(args.shape_dir, args.out, args.seed)
    print(f"random_target: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
