"""A session's KV cache that grows in place.

transformers' DynamicLayer appends a forward's keys and values by concatenation, which copies
the layer's whole cache: every forward copied all of a session's K/V (2.4 ms a forward at 300
cached positions of SmolLM2 on one core of this CPU, 8 ms at 1,200), and a batched forward paid
it once per session. ReservedLayer keeps each layer's keys and values in a buffer with room for
more positions (`room_for`) and writes the new ones into it; the cache it hands attention is a
view of the buffer's first positions, so attention reads exactly the values it read before. The
buffer grows (one copy) only when it is full, and never past the session's most positions
(`Session.most_positions`, what admission counts) unless the cache does.

Compaction after a tree (target.keep_path) and crops narrow the view in place, so the next
append writes after them; anything else that swaps the tensors is seen, and the buffer is
rebuilt from them.

The server uses it on the CPU only (TargetModel.new_cache): on a GPU the forward is bound by
the host, and there it cost 1-4% a forward (`benchmarks/results/kv_growth_gpu.md`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

MIN_RESERVE = 32  # positions of room a buffer gets at least when it grows: several forwards
NUMPY_TYPES = (torch.float16, torch.float32, torch.float64)  # what a numpy view can hold


def room_for(end: int) -> int:
    """A grown buffer's positions for `end` cached: room in proportion, so the copies stay
    rare (amortized a few positions an append) while the 4-bit engine, whose attention runs
    over the whole buffer (onnx_engine.py), wastes at most an eighth of it."""
    return end + max(MIN_RESERVE, end // 8)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose appends write into a buffer with room instead of concatenating."""

    def __init__(self, most_positions: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.most_positions = most_positions
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # numpy views, on the CPU

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._holds(end):
            self._grow(end, length, key_states, value_states)
        assert self._buffers is not None
        keys, values = self._buffers
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """update() for arrays [kv_heads, n, head_dim] (the 4-bit engine's outputs), written
        through numpy views of the buffers: the engine appends to every layer each forward,
        and numpy's writes cost a fraction of torch's indexing."""
        length = self.get_seq_length() if self.is_initialized else 0
        end = length + keys.shape[1]
        if self._arrays is None or not self._holds(end):
            self.update(torch.from_numpy(keys)[None], torch.from_numpy(values)[None])
            return
        self._arrays[0][:, length:end] = keys
        self._arrays[1][:, length:end] = values
        assert self._buffers is not None
        self.keys, self.values = (buffer[..., :end, :] for buffer in self._buffers)

    def arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Numpy views of the buffers [kv_heads, room, head_dim] under the keys and values,
        on the CPU and while they still are; positions past the cached ones hold zeros or stale
        finite values."""
        return self._arrays if self._arrays is not None and self._holds(
            self.get_seq_length()) else None

    def _holds(self, end: int) -> bool:
        """The buffers are still under the layer's keys and values, with room for `end`."""
        if self._buffers is None or self.keys is None or self.values is None:
            return False
        keys, values = self._buffers
        return (end <= keys.shape[-2] and self.keys.data_ptr() == keys.data_ptr()
                and self.values.data_ptr() == values.data_ptr()
                and self.keys.stride() == keys.stride())

    def _grow(self, end: int, length: int, *new: torch.Tensor) -> None:
        room = room_for(end)
        if self.most_positions is not None:
            room = max(end, min(room, self.most_positions))
        old = (self.keys, self.values)
        buffers = []
        for states, like in zip(old, new):
            buffer = like.new_zeros((*like.shape[:-2], room, like.shape[-1]))
            if length:
                assert states is not None
                buffer[..., :length, :] = states[..., :length, :]
            buffers.append(buffer)
        self._buffers = (buffers[0], buffers[1])
        viewable = all(b.device.type == "cpu" and b.shape[0] == 1 and b.dtype in NUMPY_TYPES
                       for b in buffers)
        self._arrays = (buffers[0][0].numpy(), buffers[1][0].numpy()) if viewable else None


def whole_cache(config: Any, in_place: bool, most_positions: int | None = None) -> DynamicCache:
    """The model's DynamicCache with every layer whole, sliding-window ones included (their
    window is applied by the mask, session_mask.py; a tree is compacted by index). `in_place`:
    the layers grow in place (ReservedLayer), with at most `most_positions` of room."""
    cache = DynamicCache(config=config)
    cache.layers = [
        (ReservedLayer(most_positions) if in_place else DynamicLayer())
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers]
    return cache


@torch.inference_mode()
def keep_path(cache: DynamicCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
    """Compacts a DynamicCache after a tree forward to the pending token plus the accepted
    path (Engine.keep_path): the accepted nodes move down to base + 1, base + 2, ... and
    everything after them is dropped."""
    new_len = base + 1 + len(accepted_nodes)
    if not accepted_nodes and cache.get_seq_length() == new_len:
        return  # a decoding step: nothing to move or drop
    src = torch.tensor([base + 1 + i for i in accepted_nodes], dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window KV layers cannot be compacted yet")
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [batch, kv_heads, seq, head_dim]
            if len(src):
                states[:, :, base + 1: new_len] = states[:, :, src.to(states.device)]
            setattr(layer, name, states[:, :, :new_len])
