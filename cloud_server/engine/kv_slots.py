"""KV caches as slots of one preallocated tensor, for the static engine.

All sessions' keys and values live in one tensor [2, layers, slots + 1, kv_heads, positions,
head_dim] allocated at startup, so a forward addresses a session by its slot index (a tensor
input of a captured graph) and never copies a cache into a batch or grows one. The last slot is
scratch: padding tokens write there, so pads are harmless by construction. A session takes a
slot when its cache is made and gives it back when the cache is dropped; compaction after a
tree moves the accepted entries down within the slot, every layer in one indexed copy.
"""
from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass

import torch

from shared.errors import Overloaded


@dataclass(frozen=True)
class SlotLayer:
    """One layer of a session's cache as transformers' layers show it."""

    keys: torch.Tensor  # [1, kv_heads, length, head_dim], a view of the pool
    values: torch.Tensor


class SlotCache:
    """A session's cache: a slot of the pool and how many positions of it hold the text."""

    def __init__(self, pool: "SlotPool", slot: int):
        self.pool = pool
        self.slot = slot
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def layers(self) -> list[SlotLayer]:
        kv = self.pool.kv[:, :, self.slot: self.slot + 1, :, : self.length]
        return [SlotLayer(kv[0, i], kv[1, i]) for i in range(kv.shape[1])]


class SlotPool:
    """`slots` session slots (and a scratch one) of `positions` each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, positions: int,
                 dtype: torch.dtype, device: torch.device):
        # kv: [2, layers, slots + 1, kv_heads, positions, head_dim]
        self.kv = torch.zeros((2, layers, slots + 1, kv_heads, positions, head_dim), dtype=dtype,
                              device=device)
        self.positions = positions
        self.scratch = slots
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()  # a cache may be dropped on another thread

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def take(self, most_positions: int | None) -> SlotCache:
        """A free slot for a session that holds at most `most_positions`."""
        if most_positions is not None and most_positions > self.positions:
            raise Overloaded(f"a session of up to {most_positions} positions does not fit a KV "
                             f"slot of {self.positions}: lower max_new_tokens or the prompt")
        if not self._free:
            gc.collect()  # a finished session's cache may wait in a reference cycle
        with self._lock:
            if not self._free:
                raise Overloaded(f"all {self.scratch} KV slots are taken: try again later")
            cache = SlotCache(self, self._free.pop())
        weakref.finalize(cache, self._give_back, cache.slot)
        return cache

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @torch.inference_mode()
    def keep_path(self, cache: SlotCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
        """Engine.keep_path: accepted entries base + 1 + i move to base + 1, base + 2, ..."""
        new_len = base + 1 + len(accepted_nodes)
        if moves(accepted_nodes):
            src = torch.tensor([base + 1 + i for i in accepted_nodes], device=self.kv.device)
            row = self.kv[:, :, cache.slot]  # [2, layers, kv_heads, positions, head_dim]
            row[:, :, :, base + 1: new_len] = row.index_select(3, src)
        cache.length = new_len


def moves(accepted_nodes: tuple[int, ...]) -> bool:
    """Whether compacting to this path moves entries: not when it is the tree's first nodes
    in order (a chain accepted from its start), which are in place already."""
    return list(accepted_nodes) != list(range(len(accepted_nodes)))
