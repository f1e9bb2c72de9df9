"""Faster fp32 linear layers on the CPU: oneDNN instead of the default MKL path.

Measured on this 2-core machine (benchmarks/verify_cost.py): PyTorch's default CPU linear runs
a decode step of SmolLM2-135M in ~50 ms and a 17-token tree forward in ~94 ms; oneDNN's linear
takes ~27 ms and ~43 ms. The result differs from MKL's only by float rounding (~1e-5 relative),
the same order as the difference between a batched and an unbatched forward; plain decoding
with the same kernels is the reference the benchmarks compare against.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Routes every fp32 CPU nn.Linear of `model` through oneDNN; returns how many.

    Checks one layer against F.linear first and changes nothing if they disagree.
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not linears or not onednn_available() or not _agrees(linears[0]):
        return 0
    for layer in linears:
        layer.forward = types.MethodType(_onednn_linear, layer)  # type: ignore[method-assign]
    return len(linears)


@torch.inference_mode()
def _agrees(layer: torch.nn.Linear) -> bool:
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    expected = F.linear(x, layer.weight, layer.bias)
    return torch.allclose(_onednn_linear(layer, x), expected, rtol=1e-4, atol=1e-4)
