"""A linear layer's weight in blocks of 32 along its input, as onnxruntime's MatMulNBits reads it.

A block holds 32 unsigned codes q, a scale d and, for 4 bits, a minimum m: w = d * q + m (GGUF's
Q4_1), or for 8 bits w = d * (q - 128) (GGUF's Q8_0, stored offset by 128). MatMulNBits has an
integer zero point only, so a Q4_1 layer is computed as MatMulNBits(x; q, d, zero 0) plus each
block's minimum times the sum of x over that block (`block_sums @ mins.T`): the same weights,
exactly, with no requantization. The weights come from the GGUF file as it ships (`from_gguf`),
or, for a checkpoint with no GGUF, from rounding its fp32 weights to 4 bits (`quantize_q4`, a
4-bit model of its own: lossless against itself, not against the fp32 weights).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.cache import cache_root

BLOCK = 32
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BYTES = 34  # fp16 d, 32 signed bytes


@dataclass(frozen=True)
class BlockWeight:
    """`codes`: [out, in // 32, 32] uint8 (0..15 or 0..255); `scales`: [out, in // 32];
    `mins`: [out, in // 32] for 4 bits, None for 8 bits (zero point 128)."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    def dense(self) -> np.ndarray:
        """The fp32 weight [out, in] these blocks stand for."""
        offset = self.mins[..., None] if self.mins is not None else -128 * self.scales[..., None]
        w = self.codes.astype(np.float32) * self.scales[..., None] + offset
        return w.reshape(self.shape).astype(np.float32)

    def rows(self, order: np.ndarray) -> "BlockWeight":
        """The same weight with its output rows taken in `order`."""
        mins = None if self.mins is None else self.mins[order]
        return BlockWeight(self.codes[order], self.scales[order], mins, self.bits)

    def packed(self) -> np.ndarray:
        """MatMulNBits' B: [out, in // 32, 32 * bits // 8], two 4-bit codes a byte, low first."""
        if self.bits == 8:
            return self.codes
        return (self.codes[..., 0::2] | (self.codes[..., 1::2] << 4)).astype(np.uint8)


def stacked(weights: list[BlockWeight]) -> BlockWeight:
    """Several layers reading the same input as one (q, k and v; gate and up)."""
    mins = None if weights[0].mins is None else np.concatenate([w.mins for w in weights])
    return BlockWeight(np.concatenate([w.codes for w in weights]),
                       np.concatenate([w.scales for w in weights]), mins, weights[0].bits)


def quantize_q4(weight: np.ndarray) -> BlockWeight:
    """Rounds an fp32 weight [out, in] to Q4_1 blocks (scale and minimum per block of 32)."""
    out, width = weight.shape
    if width % BLOCK:
        raise ValueError(f"a 4-bit layer needs an input width divisible by {BLOCK}, not {width}")
    blocks = weight.reshape(out, width // BLOCK, BLOCK).astype(np.float32)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scales = ((high - low) / 15).astype(np.float16).astype(np.float32)
    mins = low.astype(np.float16).astype(np.float32)
    safe = np.where(scales > 0, scales, 1)
    codes = np.clip(np.rint((blocks - mins[..., None]) / safe[..., None]), 0, 15)
    return BlockWeight(codes.astype(np.uint8), scales, mins, 4)


def _q4_1(raw: np.ndarray) -> BlockWeight:
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BYTES)  # [out, in // 32, 20]
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # elements 0..15, 16..31
    return BlockWeight(codes, scales, mins, 4)


def _q8_0(raw: np.ndarray) -> BlockWeight:
    blocks = raw.reshape(raw.shape[0], -1, Q8_0_BYTES)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return BlockWeight(codes, scales, None, 8)


def _unpermute(n_heads: int, rows: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (its converter interleaves each
    head's two rotary halves): GGUF row r holds checkpoint row order[r]."""
    order = np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(order)


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def from_gguf(path: Path, n_heads: int, n_kv_heads: int) -> dict[str, BlockWeight]:
    """A Llama GGUF's Q4_1 and Q8_0 layers under transformers' names (`model.layers.0.mlp.
    up_proj`, `lm_head`), with q/k rows in the checkpoint's order."""
    readers = {Q4_1: _q4_1, Q8_0: _q8_0}
    weights: dict[str, BlockWeight] = {}
    for gguf_name, (kind, data) in _layer_tensors(path).items():
        name = _hf_name(gguf_name) or gguf_name
        if kind not in readers:
            raise ValueError(f"{path.name}: {gguf_name} is GGML type {kind}; the 4-bit engine "
                             "reads Q4_1 and Q8_0 layers")
        weight = readers[kind](data)
        if name.endswith(("q_proj", "k_proj")):
            heads = n_heads if name.endswith("q_proj") else n_kv_heads
            weight = weight.rows(_unpermute(heads, weight.shape[0]))
        weights[name] = weight
    if "lm_head" not in weights and "model.embed_tokens" in weights:
        weights["lm_head"] = weights["model.embed_tokens"]  # tied head
    return weights


Q4_1, Q8_0 = 3, 8  # GGML type numbers (gguf.GGMLQuantizationType)


def _layer_tensors(path: Path) -> dict[str, tuple[int, np.ndarray]]:
    """The GGUF's linear layers as raw blocks (GGML type, bytes [rows, row bytes]), kept once
    under the cache directory: the GGUF reader parses the whole vocabulary first (~5 s)."""
    stat = path.stat()
    kept = cache_root() / "models" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}.layers.npz"
    if not kept.is_file():
        from gguf import GGUFReader

        arrays: dict[str, Any] = {}
        for tensor in GGUFReader(path).tensors:
            if _hf_name(tensor.name) is not None:
                arrays[f"{int(tensor.tensor_type)}:{tensor.name}"] = np.asarray(tensor.data)
        kept.parent.mkdir(parents=True, exist_ok=True)
        staging = kept.with_suffix(f".{os.getpid()}.npz")
        np.savez(staging, **arrays)
        staging.replace(kept)
    with np.load(kept) as stored:
        return {key.split(":", 1)[1]: (int(key.split(":", 1)[0]), stored[key])
                for key in stored.files}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if gguf_name in ("token_embd.weight", "output.weight"):
        return "model.embed_tokens" if parts[0] == "token_embd" else "lm_head"
    if parts[0] == "blk" and parts[2] in GGUF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}"
    return None
