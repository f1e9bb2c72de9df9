"""Where the target runs and in what precision (`cloud-server --device`, `--dtype`); apart from
target.py so the CLI parses them without importing torch."""
from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    AUTO = "auto"  # a CUDA GPU when torch sees one, else the CPU
    CPU = "cpu"
    CUDA = "cuda"


class Precision(StrEnum):
    AUTO = "auto"  # fp32 on the CPU (bf16 matmuls are slow there), bf16 on a GPU
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Weights(StrEnum):
    """How the target's linear layers are stored and run (`cloud-server --weights`)."""

    AUTO = "auto"  # q4 where the 4-bit engine runs the model (the CPU, a Llama), else fp32
    FP32 = "fp32"  # transformers' modules, in --dtype
    Q4 = "q4"  # the GGUF's 4-bit blocks in one onnxruntime graph (cloud_server/onnx_engine.py)
