"""Faster fp32 linear layers on the CPU: oneDNN with weights packed once, instead of the default
MKL path.

oneDNN reorders a plain weight into its blocked layout on every call of more than one row, and
its kernels for one or two rows are slower than its kernel for four to six. So each weight is
packed once at load time (`_reorder_linear_weight`) and a call of fewer than MIN_ROWS rows is
padded to MIN_ROWS: a decode step is faster and a small tree costs about one step (results
log, `sweep` and `verify_cost`). The result differs from MKL's only by float rounding (~1e-5
relative), the same order as the difference between a batched and an unbatched forward;
plain decoding with the same kernels is the reference the benchmarks compare against.

The packed copy is taken at load time: the model's weights must not change afterwards, and the
layers hold one more copy of their weights (the original stays, for tied embeddings and for
whatever reads the parameters).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # fewer rows run a slower oneDNN kernel than 4 do (see the module docstring)
PACKED_FOR_ROWS = 16  # the row count oneDNN picks its blocked layout for: a typical tree forward


def onednn_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_reorder_linear_weight"))


def _packed_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[:-1].numel()
    if rows == 0 or rows >= MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
    padded = F.pad(x.reshape(rows, -1), (0, 0, 0, MIN_ROWS - rows))
    out = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], -1)


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Routes every fp32 CPU nn.Linear of `model` through oneDNN with a packed copy of its
    weight; returns how many.

    Checks one layer against F.linear first and changes nothing if they disagree.
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not linears or not onednn_available() or not _agrees(linears[0]):
        return 0
    for layer in linears:
        _pack(layer)
    return len(linears)


@torch.inference_mode()
def _pack(layer: torch.nn.Linear) -> None:
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(),
                                                                  PACKED_FOR_ROWS)
    layer.forward = types.MethodType(_packed_linear, layer)  # type: ignore[method-assign]


@torch.inference_mode()
def _agrees(layer: torch.nn.Linear) -> bool:
    probe = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    probe.load_state_dict(layer.state_dict())
    _pack(probe)
    for rows in (1, 3):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        if not torch.allclose(probe(x), F.linear(x, layer.weight, layer.bias),
                              rtol=1e-4, atol=1e-4):
            return False
    return True
