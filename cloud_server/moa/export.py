"""The edge half as ONNX graphs whose K/V state lives outside them (docs/architecture.md, Drafters).

Two graphs, batch dimension dropped (the edge drafts one text):
- `memory.onnx`: activations: [m, width] f32, positions: [m] i64 -> mem_keys, mem_values:
  [kv_heads, m, head_dim], the Cross-Attention K/V of newly verified positions. The edge appends
  them to its memory once per verdict. A drafter whose memory is the tokens' embeddings (the
  Independent baseline, Memory.EMBEDDINGS) takes ids: [m] i64 instead of activations.
- `step.onnx`: ids: [q] i64, positions: [q] i64, past_keys, past_values:
  [kv_heads, p, head_dim] (Self-Attention K/V of the tokens the queries may attend to besides
  themselves), allowed: [q, p + q] bool (tree mask), mem_keys, mem_values -> logits:
  [q, head_size] (over the draft head's rows), top_logprobs: [q, top_k] (log q, normalised
  over the head), top_ids: [q, top_k] (target token ids), keys, values: [kv_heads, q, head_dim]
  (the queries' own SA K/V, for the edge to keep or drop). A recurrent drafter's also takes
  features: [q, width] (each query's previous position's feature) and returns own_features:
  [q, width] (the queries' outputs through the server half, fed to their children).
  With Target Layer Inference (config "tli_layers" = N) the K/V state holds N more layers:
  past_keys, past_values, keys, values have kv_heads * (1 + N) heads, the Self-Attention's
  first, then each target layer's in order.
Knows nothing of how the edge builds trees. Uses torch's TorchScript-based exporter: it needs
only `onnx`, where the dynamo exporter would pull in onnxscript.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from cloud_server.moa.layers import additive_mask
from cloud_server.moa.model import EdgeHalf
from shared.drafter_bundle import GRAPH_FILES, Graph, MemoryIO, Precision, StepIO

FILES = GRAPH_FILES[Precision.FP32]
OPSET = 17
TOP_K = 8


class MemoryGraph(nn.Module):
    def __init__(self, edge: EdgeHalf) -> None:
        super().__init__()
        self.edge = edge

    def forward(self, rows: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: activations [m, width] or ids [m], positions: [m] -> keys, values:
        [kv_heads, m, hd]"""
        if not self.edge.config.uses_activations:
            rows = self.edge.embedding[rows]
        keys, values = self.edge.memory_kv(rows[None], positions)
        return keys[0], values[0]


class StepGraph(nn.Module):
    """`fusion` is the server half of a recurrent drafter (None otherwise): its own features
    go through it, to the space of the activations it is fed where a position is verified."""

    def __init__(self, edge: EdgeHalf, top_k: int, fusion: nn.Module | None = None) -> None:
        super().__init__()
        self.edge, self.top_k, self.fusion = edge, top_k, fusion

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
                past_values: torch.Tensor, allowed: torch.Tensor, mem_keys: torch.Tensor,
                mem_values: torch.Tensor,
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """See the module docstring for shapes."""
        kvh = self.edge.config.kv_heads
        x = self.edge.inputs(ids[None], None if features is None else features[None])
        keys, values = self.edge.sa_kv_of(x, positions)  # [1, kvh, q, hd]
        all_keys = torch.cat((past_keys[None, :kvh], keys), dim=2)  # [1, kvh, p + q, hd]
        all_values = torch.cat((past_values[None, :kvh], values), dim=2)  # [1, kvh, p + q, hd]
        mask = additive_mask(allowed)[None, None]  # [1, 1, q, p + q]
        raw = self.edge.raw(x, positions, all_keys, all_values, mask, mem_keys[None],
                            mem_values[None], None)  # [1, q, width]
        last = raw
        if self.edge.tli is not None:  # [1, N * kvh, p, hd] in, [1, N * kvh, q, hd] out
            last, tli_keys, tli_values = self.edge.tli(raw, positions, mask,
                                                       past_keys[None, kvh:],
                                                       past_values[None, kvh:])
            keys = torch.cat((keys, tli_keys), dim=1)  # [1, kvh * (1 + N), q, hd]
            values = torch.cat((values, tli_values), dim=1)
        logits = self.edge.logits(self.edge.normed(last[0]))  # [q, head_size]
        top_logprobs, top_rows = logits.log_softmax(-1).topk(self.top_k, dim=-1)  # [q, k]
        top_ids = self.edge.vocab_ids[top_rows]  # [q, k]: target token ids
        outputs = (logits, top_logprobs, top_ids, keys[0], values[0])
        if self.fusion is None:
            return outputs
        return (*outputs, self.fusion(raw[0][:, None]))  # own features: [q, width]


def example_inputs(edge: EdgeHalf) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Small inputs with distinct sizes for every dynamic axis (memory, step)."""
    c = edge.config
    q, p, m = 3, 5, 4
    heads = c.kv_heads * c.layer_states
    rows = torch.randn(m, c.width) if c.uses_activations else torch.randint(0, c.vocab_size, (m,))
    memory = (rows, torch.arange(m))
    step: tuple[torch.Tensor, ...] = (torch.randint(0, c.vocab_size, (q,)), torch.arange(p, p + q),
            torch.randn(heads, p, c.head_dim), torch.randn(heads, p, c.head_dim),
            torch.ones(q, p + q, dtype=torch.bool), torch.randn(c.kv_heads, m, c.head_dim),
            torch.randn(c.kv_heads, m, c.head_dim))
    if c.recurrent:
        step += (torch.randn(q, c.width),)
    return memory, step


def export_edge(edge: EdgeHalf, out: Path, top_k: int = TOP_K,
                fusion: nn.Module | None = None) -> None:
    """Writes the fp32 memory and step graphs (shared/drafter_bundle.py) into `out`; a
    recurrent drafter's step graph also holds its server half, `fusion`."""
    if edge.config.recurrent and fusion is None:
        raise ValueError("a recurrent drafter's step graph needs its server half")
    edge = edge.float().cpu().eval()
    fusion = (fusion.float().cpu().eval()
              if edge.config.recurrent and fusion is not None else None)
    memory_args, step_args = example_inputs(edge)
    out.mkdir(parents=True, exist_ok=True)
    rows = MemoryIO.rows(edge.config.memory)
    recurrent = edge.config.recurrent
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            MemoryGraph(edge), memory_args, str(out / FILES[Graph.MEMORY]), dynamo=False,
            opset_version=OPSET, input_names=[rows, MemoryIO.POSITIONS],
            output_names=[MemoryIO.KEYS, MemoryIO.VALUES],
            dynamic_axes={rows: {0: "m"}, MemoryIO.POSITIONS: {0: "m"},
                          MemoryIO.KEYS: {1: "m"}, MemoryIO.VALUES: {1: "m"}})
        logits, top_logprobs, top_ids, keys, values = StepIO.OUTPUTS
        axes = {StepIO.IDS: {0: "q"}, StepIO.POSITIONS: {0: "q"},
                StepIO.PAST_KEYS: {1: "p"}, StepIO.PAST_VALUES: {1: "p"},
                StepIO.ALLOWED: {0: "q", 1: "pq"}, StepIO.MEM_KEYS: {1: "m"},
                StepIO.MEM_VALUES: {1: "m"}, logits: {0: "q"}, top_logprobs: {0: "q"},
                top_ids: {0: "q"}, keys: {1: "q"}, values: {1: "q"},
                StepIO.FEATURES: {0: "q"}, StepIO.OWN_FEATURES: {0: "q"}}
        torch.onnx.export(
            StepGraph(edge, top_k, fusion), step_args, str(out / FILES[Graph.STEP]),
            dynamo=False, opset_version=OPSET, input_names=list(StepIO.inputs(recurrent)),
            output_names=list(StepIO.outputs(recurrent)),
            dynamic_axes={k: v for k, v in axes.items()
                          if k in StepIO.inputs(recurrent) + StepIO.outputs(recurrent)})
    for name in FILES.values():
        constants_to_initializers(out / name)


def constants_to_initializers(path: Path) -> None:
    """Turns the exporter's Constant nodes into initializers, in place.

    The shared embedding and head are buffers, which the TorchScript exporter writes as Constant
    nodes; onnxruntime's quantizer only quantizes initializers, so without this the int8 graph
    kept the 113 MB fp32 embedding and an fp32 head."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    for node in [n for n in graph.node if n.op_type == "Constant"]:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if value is None:
            continue
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value.t)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        graph.node.remove(node)
    onnx.save(model, str(path))


class _NoPreprocessingAdvice(logging.Filter):
    """Drops the advice quantize_dynamic logs on the root logger for every graph it is given:
    to pre-process it first (shape inference, graph fusions). It infers shapes itself, and the
    MatMul and Gather weights quantized here are meant as the export wrote them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Please consider to run pre-processing")


def quantize_int8(source: Path, dest: Path) -> None:
    """Dynamic int8 quantization of MatMul weights and the embedding Gather (onnxruntime)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    advice, root = _NoPreprocessingAdvice(), logging.getLogger()
    root.addFilter(advice)
    try:
        quantize_dynamic(str(source), str(dest), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gather"])
    finally:
        root.removeFilter(advice)
