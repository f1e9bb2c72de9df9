"""Where the target runs, in what precision and on which engine (`cloud-server --device`,
`--dtype`, `--weights`, `--engine`, `--cuda-graphs`); apart from target.py so the CLI parses
them without importing torch."""
from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    AUTO = "auto"  # a CUDA GPU when torch sees one, else the CPU
    CPU = "cpu"
    CUDA = "cuda"


class Precision(StrEnum):
    AUTO = "auto"  # bf16 on a GPU; on the CPU the checkpoint's bf16, else fp32
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Weights(StrEnum):
    """How the target's linear layers are stored and run (`cloud-server --weights`)."""

    AUTO = "auto"  # q4 for a model from a 4-bit GGUF where the engine runs it, else fp32
    FP32 = "fp32"  # transformers' modules, in --dtype
    Q4 = "q4"  # the GGUF's 4-bit blocks in one onnxruntime graph (cloud_server/engine/onnx_engine.py)


class EngineChoice(StrEnum):
    """What runs `--weights fp32` (unquantized weights in --dtype): cloud_server/engine/."""

    AUTO = "auto"  # static where it runs the model on a GPU, else transformers
    STATIC = "static"  # static shapes over KV slots, CUDA graphs on a GPU (static_engine.py)
    TRANSFORMERS = "transformers"  # transformers' modules, eager (transformers_engine.py)


class Graphs(StrEnum):
    """Whether the static engine replays its buckets from CUDA graphs (`--cuda-graphs`)."""

    AUTO = "auto"  # on when the target runs on CUDA
    ON = "on"
    OFF = "off"
    # as on a GPU (the static engine, padded to the buckets, each captured at startup), but
    # each shape runs eagerly under the graphs' contract (cuda_graphs.Rehearsal): a GPU
    # server's forwards reproduced on a CPU, or a capture ruled out on a GPU
    REHEARSE = "rehearse"
