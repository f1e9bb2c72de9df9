"""A Llama forward pass as one onnxruntime graph, with 4-/8-bit block weights (block_weights.py).

Knows nothing of sessions or trees: the graph maps the new tokens of B sessions (side by side,
`lengths` [B]) to logits of the rows asked for and to each layer's new keys and values, which
the caller appends to its caches. Each session's cached keys and values come in as they lie in
its cache buffer ([kv_heads, room, head_dim], room >= what is cached), with an additive mask
[groups * new, room + new] that hides the room not yet written and whatever the session's tree
mask hides; so the graph never copies a cache. Attention runs per session, as in ragged.py:
the projections, MLP and head run on all sessions' tokens at once. The input is the tokens'
embeddings [T, width], looked up by the caller.

Layer i's output (the residual stream after it) is the graph output `hidden_i`, for a drafter
fed by the target's hidden states (layer_outputs.py does the same for the torch forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cloud_server.engine.block_weights import BLOCK, BlockWeight, stacked

OPSET = 17
# Keys in fp32, values in double: the weighted sum over the values is taken in double, where how
# a tree forward and a decoding step group its terms no longer shows once rounded to fp32.
KV_TYPES = {"k": TensorProto.FLOAT, "v": TensorProto.DOUBLE}
IR_VERSION = 10  # what onnxruntime 1.20 and newer read


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class LlamaWeights:
    """Block weights by transformers' layer names, fp32 norms and the rotary inverse
    frequencies [head_dim / 2] with their scaling. The embedding is not here: the caller looks
    the tokens up (`embeds` [T, width]), so the graphs for each session count share its table."""

    blocks: dict[str, BlockWeight]
    norms: dict[str, np.ndarray]
    inv_freq: np.ndarray
    rope_scaling: float


class _Graph:
    """Collects nodes, initializers and names while the forward is written out. `consts` keeps
    the converted weights between builds (one graph per session count)."""

    def __init__(self, consts: dict[str, TensorProto]) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._consts = consts
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, key: str, value: Callable[[], np.ndarray]) -> str:
        """A weight named `key`, computed and converted once across builds."""
        if key not in self._consts:
            self._consts[key] = numpy_helper.from_array(np.ascontiguousarray(value()), key)
        self.initializers.append(self._consts[key])
        return key

    def op(self, kind: str, *inputs: str, out: str | None = None, domain: str = "",
           **attrs: Any) -> str:
        result = out or self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [result], domain=domain, **attrs))
        return result

    def ops(self, kind: str, inputs: list[str], outputs: int, **attrs: Any) -> list[str]:
        results = [self.name(kind.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, results, **attrs))
        return results

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), "shape")


def _linear(g: _Graph, x: str, name: str, weights: list[BlockWeight]) -> str:
    """x [T, in] @ W.T -> [T, out], W the `weights` stacked by rows, with MatMulNBits on int8
    activations (accuracy level 4); `name` keys the converted weight."""
    out, width = sum(w.shape[0] for w in weights), weights[0].shape[1]
    blocks, bits = width // BLOCK, weights[0].bits
    zero_shape = (out, (blocks + 1) // 2 if bits == 4 else blocks)
    y = g.op("MatMulNBits", x, g.weight(name, lambda: stacked(weights).packed()),
             g.weight(name + ".scales", lambda: stacked(weights).scales.reshape(-1)),
             g.weight(name + ".zeros", lambda: np.full(zero_shape, 0 if bits == 4 else 128,
                                                       np.uint8)),
             domain="com.microsoft", K=width, N=out, bits=bits, block_size=BLOCK,
             accuracy_level=4)
    if weights[0].mins is None:
        return y
    sums = g.op("ReduceSum", g.op("Reshape", x, g.ints(-1, blocks, BLOCK)), g.ints(2),
                keepdims=0)  # [T, in // 32]
    mins = g.weight(name + ".mins", lambda: np.concatenate([w.mins for w in weights]).T)
    return g.op("Add", y, g.op("MatMul", sums, mins))


def _rms_norm(g: _Graph, x: str, weight: np.ndarray, eps: float) -> str:
    """The pattern onnxruntime fuses into SimplifiedLayerNormalization."""
    square = g.op("Pow", x, g.const(np.array(2.0, np.float32)))
    mean = g.op("ReduceMean", square, axes=[-1], keepdims=1)
    root = g.op("Sqrt", g.op("Add", mean, g.const(np.array(eps, np.float32))))
    return g.op("Mul", g.op("Div", x, root), g.const(weight.astype(np.float32), "norm"))


def _rotate(g: _Graph, x: str, heads: int) -> str:
    """Rotary embedding of x [1, T, heads * head_dim] at `positions`, transformers' convention
    (the halves rotated, not interleaved), from the `cos` and `sin` tables [T, head_dim / 2]."""
    return g.op("RotaryEmbedding", x, "rope_positions", "cos", "sin", domain="com.microsoft",
                num_heads=heads, interleaved=0)


def _attend(g: _Graph, s: LlamaShape, q: str, k: str, v: str, layer: int, b: int) -> str:
    """One session's attention: q [kv_heads, groups, t, head_dim], its new k and v
    [kv_heads, t, head_dim] -> [t, width], over its cache and its new tokens."""
    scale = float(s.head_dim ** -0.5)
    q = g.op("Reshape", q, g.ints(s.kv_heads, -1, s.head_dim))  # [kv, groups * t, hd]
    past_k, past_v = f"past_k_{layer}_{b}", f"past_v_{layer}_{b}"
    scores = g.op("Concat",
                  g.op("FusedMatMul", q, past_k, domain="com.microsoft", transB=1, alpha=scale),
                  g.op("FusedMatMul", q, k, domain="com.microsoft", transB=1, alpha=scale),
                  axis=-1)  # [kv, groups * t, room + t]
    scores = g.op("Add", scores, f"mask_{b}")
    weights = g.op("Exp", g.op("Sub", scores, g.op("ReduceMax", scores, axes=[-1], keepdims=1)))
    weights = g.op("Cast", weights, to=TensorProto.DOUBLE)  # sums in double: see below
    w_past, w_new = g.ops("Split", [weights, f"parts_{b}"], 2, axis=-1)
    total = g.op("Add", g.op("MatMul", w_past, past_v), g.op("MatMul", w_new, v))
    norm = g.op("ReduceSum", weights, g.ints(-1), keepdims=1)
    out = g.op("Cast", g.op("Div", total, norm), to=TensorProto.FLOAT)
    out = g.op("Reshape", out, g.ints(s.kv_heads, s.groups, -1, s.head_dim))
    out = g.op("Transpose", out, perm=[2, 0, 1, 3])  # [t, kv, groups, hd]
    return g.op("Reshape", out, g.ints(-1, s.heads * s.head_dim))


def _layer(g: _Graph, s: LlamaShape, w: LlamaWeights, x: str, i: int, sessions: int) -> str:
    prefix = f"model.layers.{i}."
    names = [prefix + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
    h = _rms_norm(g, x, w.norms[prefix + "input_layernorm"], s.eps)
    kv_width = s.kv_heads * s.head_dim
    qkv = g.op("Unsqueeze", _linear(g, h, prefix + "qkv", [w.blocks[n] for n in names]),
               g.ints(0))  # [1, T, q + k + v widths]
    q, k, v = g.ops("Split", [qkv, g.ints(s.heads * s.head_dim, kv_width, kv_width)], 3, axis=-1)
    q, k = _rotate(g, q, s.heads), _rotate(g, k, s.kv_heads)
    k = g.op("Transpose", g.op("Reshape", k, g.ints(-1, s.kv_heads, s.head_dim)),
             perm=[1, 0, 2], out=f"new_k_{i}")  # [kv, T, hd]
    v = g.op("Transpose", g.op("Reshape", g.op("Cast", v, to=TensorProto.DOUBLE),
                               g.ints(-1, s.kv_heads, s.head_dim)),
             perm=[1, 0, 2], out=f"new_v_{i}")  # [kv, T, hd], in double: see _attend
    q = g.op("Transpose", g.op("Reshape", q, g.ints(-1, s.kv_heads, s.groups, s.head_dim)),
             perm=[1, 2, 0, 3])  # [kv, groups, T, hd]
    if sessions == 1:
        attended = _attend(g, s, q, k, v, i, 0)
    else:
        qs = g.ops("Split", [q, "lengths"], sessions, axis=2)
        ks = g.ops("Split", [k, "lengths"], sessions, axis=1)
        vs = g.ops("Split", [v, "lengths"], sessions, axis=1)
        attended = g.op("Concat", *[_attend(g, s, qs[b], ks[b], vs[b], i, b)
                                    for b in range(sessions)], axis=0)
    o_name = prefix + "self_attn.o_proj"
    x = g.op("Add", x, _linear(g, attended, o_name, [w.blocks[o_name]]))
    h = _rms_norm(g, x, w.norms[prefix + "post_attention_layernorm"], s.eps)
    up_names = [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"]
    gate, up = g.ops("Split", [_linear(g, h, prefix + "gate_up", [w.blocks[n] for n in up_names]),
                               g.ints(s.intermediate, s.intermediate)], 2, axis=-1)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    down = prefix + "mlp.down_proj"
    return g.op("Add", x, _linear(g, act, down, [w.blocks[down]]), out=f"hidden_{i}")


def _rope_tables(g: _Graph, w: LlamaWeights) -> None:
    """`cos` and `sin` [T, head_dim / 2] at `positions`, as transformers' rotary embedding, and
    the row of each token in them (`rope_positions` [1, T])."""
    position = g.op("Unsqueeze", g.op("Cast", "positions", to=TensorProto.FLOAT), g.ints(1))
    angles = g.op("Mul", position, g.const(w.inv_freq.astype(np.float32), "inv_freq"))
    scaling = g.const(np.array(w.rope_scaling, np.float32))
    g.op("Mul", g.op("Cos", angles), scaling, out="cos")
    g.op("Mul", g.op("Sin", angles), scaling, out="sin")
    tokens = g.op("Shape", "positions")
    g.op("Unsqueeze", g.op("Range", g.const(np.array(0, np.int64)),
                           g.op("Squeeze", tokens, g.ints(0)), g.const(np.array(1, np.int64))),
         g.ints(0), out="rope_positions")


def build(s: LlamaShape, w: LlamaWeights, sessions: int,
          consts: dict[str, TensorProto]) -> onnx.ModelProto:
    """The forward of `sessions` sessions' new tokens in one graph; `consts`: the weights
    converted by an earlier build, filled in by this one."""
    g = _Graph(consts)
    _rope_tables(g, w)
    x = "embeds"
    for i in range(s.layers):
        x = _layer(g, s, w, x, i, sessions)
    final = _rms_norm(g, x, w.norms["model.norm"], s.eps)
    rows = g.op("Gather", final, "keep", axis=0)
    g.op("Identity", _linear(g, rows, "lm_head", [w.blocks["lm_head"]]), out="logits")
    return _model(g, s, sessions)


def _model(g: _Graph, s: LlamaShape, sessions: int) -> onnx.ModelProto:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, i64, [d]) for n, d in
              (("positions", "T"), ("keep", "R"))]
    inputs.insert(0, helper.make_tensor_value_info("embeds", f, ["T", s.width]))
    if sessions > 1:
        inputs.append(helper.make_tensor_value_info("lengths", i64, [sessions]))
    for b in range(sessions):
        inputs += [helper.make_tensor_value_info(f"mask_{b}", f, [f"gt_{b}", f"S_{b}"]),
                   helper.make_tensor_value_info(f"parts_{b}", i64, [2])]
        inputs += [helper.make_tensor_value_info(f"past_{kv}_{i}_{b}", KV_TYPES[kv],
                                                 [s.kv_heads, f"room_{b}", s.head_dim])
                   for i in range(s.layers) for kv in "kv"]
    outputs = [helper.make_tensor_value_info("logits", f, ["R", s.vocab])]
    outputs += [helper.make_tensor_value_info(f"new_{kv}_{i}", KV_TYPES[kv],
                                              [s.kv_heads, "T", s.head_dim])
                for i in range(s.layers) for kv in "kv"]
    outputs += [helper.make_tensor_value_info(f"hidden_{i}", f, ["T", s.width])
                for i in range(s.layers)]
    graph = helper.make_graph(g.nodes, "llama_forward", inputs, outputs, g.initializers)
    return helper.make_model(graph, ir_version=IR_VERSION,
                             opset_imports=[helper.make_opsetid("", OPSET),
                                            helper.make_opsetid("com.microsoft", 1)])
