"""Mixed-precision weights for the edge half's graphs: the bytes go where drafting reads them.

The embedding of SmolLM2 is 49,152 x 576, most of a bundle, yet drafting reads few of its rows
well: the draft head's (FR-Spec's frequency-ranked sub-vocabulary, Zhao et al. 2025), which
score every drafted token and embed every drafted token, and now and then a round's first
token from outside it. So (LOG bundle_mixed):
- the draft rows (the embedding's rows the head is made of, tied as in SmolLM2, or the draft
  vocabulary's rows of an untied head) in int8, one scale a row;
- the embedding's other rows in COLD_BITS-bit codes, one fp16 scale per BLOCK weights
  (absmax-based, the least-error of a few divisors), in the layout of onnxruntime's
  GatherBlockQuantized (a contrib op), which decodes only the rows a step reads; each id is
  gathered from the table that holds it (a decode at load instead took 1 GB to fold);
- every other matrix (the drafter's own layers) in int8, one scale per output column:
  DynamicQuantizeMatMul, the int8 precision's kernel.
Top-1 agreement with the fp32 graph by part, 4 bits everywhere against this: LOG bundle_mixed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

BLOCK = 32  # weights per scale of the cold rows
COLD_BITS = 2  # the embedding rows outside the draft vocabulary
DIVISORS = (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)  # of absmax / max code: a block's candidates
CHUNK_ROWS = 4096  # rows quantized at once: the candidates' errors stay within ~100 MB
MS_DOMAIN = "com.microsoft"
INT8_MAX = 127.0


def int8_rows(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weights: [rows, K] -> int8 [rows, K], scales [rows] f32 (absmax / 127)."""
    scales = np.abs(weights).max(axis=1) / INT8_MAX
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(weights / scales[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scales.astype(np.float32)


def quantize_blocks(weights: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """weights: [rows, K] -> codes: [rows, K * bits / 8] uint8 (8 / bits to a byte, lowest
    bits first), scales: [rows, K / BLOCK] fp16, so that row r, column j is
    (code - 2^(bits-1)) * scale[r, j // BLOCK]."""
    rows, k = weights.shape
    codes = np.empty((rows, k * bits // 8), np.uint8)
    scales = np.empty((rows, k // BLOCK), np.float16)
    for start in range(0, rows, CHUNK_ROWS):
        part = slice(start, start + CHUNK_ROWS)
        codes[part], scales[part] = _quantize_chunk(weights[part].astype(np.float32), bits)
    return codes, scales


def _quantize_chunk(weights: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    rows, k = weights.shape
    low, high = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    blocks = weights.reshape(rows, k // BLOCK, BLOCK)
    absmax = np.abs(blocks).max(axis=-1)  # [rows, K / BLOCK]
    best_scale = best_error = None
    for divisor in DIVISORS:
        scale = (absmax / (max(high, 1) * divisor)).astype(np.float16)
        scale[scale == 0] = 1.0
        wide = scale[..., None].astype(np.float32)
        error = ((np.clip(np.rint(blocks / wide), low, high) * wide - blocks) ** 2).sum(axis=-1)
        better = np.ones_like(error, bool) if best_error is None else error < best_error
        best_scale = scale if best_scale is None else np.where(better, scale, best_scale)
        best_error = error if best_error is None else np.where(better, error, best_error)
    assert best_scale is not None
    wide = best_scale[..., None].astype(np.float32)
    codes = (np.clip(np.rint(blocks / wide), low, high) - low).astype(np.uint8)
    per_byte = codes.reshape(rows, -1, 8 // bits)
    packed = sum(per_byte[..., i] << (i * bits) for i in range(8 // bits))
    return packed.astype(np.uint8), best_scale


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of quantize_blocks: -> [rows, K] f32."""
    rows = codes.shape[0]
    table = _byte_table(bits)  # [256, 8 / bits]
    unpacked = table[codes].reshape(rows, -1, BLOCK).astype(np.float32) - 2 ** (bits - 1)
    return (unpacked * scales[..., None].astype(np.float32)).reshape(rows, -1)


def _byte_table(bits: int) -> np.ndarray:
    """[256, 8 / bits] uint8: each byte's codes, lowest bits first."""
    byte = np.arange(256, dtype=np.uint16)[:, None]
    shifts = np.arange(0, 8, bits, dtype=np.uint16)[None]
    return ((byte >> shifts) & (2 ** bits - 1)).astype(np.uint8)


def quantize_mixed(source: Path, dest: Path, draft_rows: np.ndarray | None,
                   tied: bool) -> None:
    """Writes `source`'s graph with mixed-precision weights to `dest`. `draft_rows`: the
    embedding rows drafting reads most (the draft vocabulary; None: every row); `tied`: the
    head is the embedding's `draft_rows`, stored once."""
    import onnx

    model = onnx.load(str(source))
    rewrite = _Rewrite(model.graph, draft_rows, tied)
    for node in list(model.graph.node):
        if node.op_type == "Gather" and rewrite.table_of(node) is not None:
            rewrite.gather(node)
    for node in list(model.graph.node):
        if node.op_type == "MatMul" and rewrite.weight_of(node) is not None:
            rewrite.matmul(node)
    rewrite.drop_unused()
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save(model, str(dest))


class _Rewrite:
    """One graph's rewrite; the embedding's draft rows, once stored, serve a tied head."""

    def __init__(self, graph, draft_rows: np.ndarray | None, tied: bool) -> None:
        from onnx import numpy_helper

        self.graph, self.draft_rows, self.tied = graph, draft_rows, tied
        self.constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.embedding: np.ndarray | None = None
        self.head: tuple[str, str] | None = None  # the draft rows' int8 and scales

    def _add(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.graph.initializer.append(numpy_helper.from_array(value, name))
        self.constants[name] = value
        return name

    def _float_matrix(self, name: str) -> np.ndarray | None:
        value = self.constants.get(name)
        if value is None or value.dtype != np.float32 or value.ndim != 2:
            return None
        return value

    def table_of(self, node) -> np.ndarray | None:
        """The embedding table a Gather reads rows of, if it is one this can store."""
        table = self._float_matrix(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        return table if table is not None and axis == 0 and table.shape[1] % BLOCK == 0 else None

    def weight_of(self, node) -> np.ndarray | None:
        """The constant weight [K, N] a MatMul multiplies by."""
        return self._float_matrix(node.input[1])

    def gather(self, node) -> None:
        """Gather(table, ids) -> the draft rows' int8 gathered and scaled by row, the other
        rows' codes gathered by GatherBlockQuantized, each id's from its own table."""
        from onnx import TensorProto, helper

        table = self.table_of(node)
        assert table is not None
        name, ids, out = node.input[0], node.input[1], node.output[0]
        draft = (np.arange(len(table)) if self.draft_rows is None
                 else np.asarray(self.draft_rows, np.int64))
        cold = np.setdiff1d(np.arange(len(table)), draft)
        hot_codes, hot_scales = int8_rows(table[draft])
        self.embedding = table
        self.head = (self._add(f"{name}_draft_int8", hot_codes),
                     self._add(f"{name}_draft_scales", hot_scales))
        hot = f"{out}_draft" if len(cold) else out
        made = self._draft_rows(name, ids, hot, draft, len(table))
        if len(cold):
            codes, scales = quantize_blocks(table[cold], COLD_BITS)
            is_draft = np.zeros(len(table), bool)
            is_draft[draft] = True
            made += [
                helper.make_node("Gather", [self._add(f"{name}_cold_slot", _slots(
                    cold, len(table))), ids], [f"{out}_cold_slot"], axis=0),
                helper.make_node("GatherBlockQuantized", [
                    self._add(f"{name}_cold_codes", codes), f"{out}_cold_slot",
                    self._add(f"{name}_cold_scales", scales)], [f"{out}_cold_f16"],
                    name=f"{out}_cold", domain=MS_DOMAIN, gather_axis=0, quantize_axis=1,
                    block_size=BLOCK, bits=COLD_BITS),
                helper.make_node("Cast", [f"{out}_cold_f16"], [f"{out}_cold"],
                                 to=TensorProto.FLOAT),
                helper.make_node("Gather", [self._add(f"{name}_is_draft", is_draft), ids],
                                 [f"{out}_is_draft"], axis=0),
                helper.make_node("Unsqueeze", [f"{out}_is_draft", self._last_axis()],
                                 [f"{out}_is_draft_x"]),
                helper.make_node("Where", [f"{out}_is_draft_x", hot, f"{out}_cold"], [out])]
        self._replace(node, made)

    def _draft_rows(self, name: str, ids: str, out: str, draft: np.ndarray,
                    vocab: int) -> list:
        """Nodes gathering `ids`' rows of the draft rows' int8 into f32 `out` (an id outside
        them gets the first, for the caller to discard)."""
        from onnx import TensorProto, helper

        assert self.head is not None
        slot = f"{out}_slot"
        return [
            helper.make_node("Gather", [self._add(f"{name}_draft_slot", _slots(draft, vocab)),
                                        ids], [slot], axis=0),
            helper.make_node("Gather", [self.head[0], slot], [f"{out}_int8"], axis=0),
            helper.make_node("Cast", [f"{out}_int8"], [f"{out}_wide"], to=TensorProto.FLOAT),
            helper.make_node("Gather", [self.head[1], slot], [f"{out}_row_scales"], axis=0),
            helper.make_node("Unsqueeze", [f"{out}_row_scales", self._last_axis()],
                             [f"{out}_row_scales_x"]),
            helper.make_node("Mul", [f"{out}_wide", f"{out}_row_scales_x"], [out])]

    def matmul(self, node) -> None:
        """MatMul(x, W) -> DynamicQuantizeMatMul(x, int8 W, a scale per output column)."""
        from onnx import helper

        weight = self.weight_of(node)
        assert weight is not None
        base, made = node.input[1], []
        if self._is_tied_head(weight):
            assert self.head is not None
            made.append(helper.make_node("Transpose", [self.head[0]], [f"{base}_int8"],
                                         perm=[1, 0]))  # [K, N], folded at load
            scales = self.head[1]
        else:
            codes, column_scales = int8_rows(weight.T)
            self._add(f"{base}_int8", np.ascontiguousarray(codes.T))
            scales = self._add(f"{base}_int8_scales", column_scales)
        made.append(helper.make_node(
            "DynamicQuantizeMatMul", [node.input[0], f"{base}_int8", scales], list(node.output),
            name=f"{node.output[0]}_int8", domain=MS_DOMAIN))
        self._replace(node, made)

    def _is_tied_head(self, weight: np.ndarray) -> bool:
        if not self.tied or self.embedding is None or self.draft_rows is None:
            return False
        rows = self.embedding[self.draft_rows]
        return weight.shape == rows.T.shape and np.array_equal(weight.T, rows)

    def _last_axis(self) -> str:
        name = "mixed_last_axis"
        return name if name in self.constants else self._add(name, np.array([-1], np.int64))

    def _replace(self, node, made: list) -> None:
        at = list(self.graph.node).index(node)
        self.graph.node.remove(node)
        for offset, new in enumerate(made):
            self.graph.node.insert(at + offset, new)

    def drop_unused(self) -> None:
        """Removes the float tables the rewritten nodes no longer read."""
        used = {name for node in self.graph.node for name in node.input}
        used |= {o.name for o in self.graph.output}
        for tensor in [t for t in self.graph.initializer if t.name not in used]:
            self.graph.initializer.remove(tensor)


def _slots(rows: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] int32: each of `rows`' position among them, 0 for the other ids."""
    slots = np.zeros(vocab, np.int32)
    slots[rows] = np.arange(len(rows), dtype=np.int32)
    return slots
