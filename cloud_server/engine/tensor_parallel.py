"""The static engine's model split over N ranks by tensor parallelism: what each rank holds and
the one sum per block that joins them (Megatron-LM, Shoeybi et al. 2019, section 3; gpt-fast's
tp.py shows the same split of a Llama in about 150 lines).

In each block, q, k and v are split by heads and gate and up by columns (column-parallel: a rank
computes its heads' attention and its columns of the MLP from the whole input, with no
communication); o and down are split by rows (row-parallel: each rank's product is a partial sum
of the output), so one all-reduce after each joins them, two a block. A rank's KV slots hold its
own KV heads, so the tree masks, positions, slots and compaction run on every rank as on one
device. The embedding is held whole on every rank (the input of the first block is whole);
after the last all-reduce the final hidden states are whole on every rank too, so rank 0 alone
computes the logits of the wanted rows from them, with no gather (the head is held on rank 0
only, unless it is the embedding). Knows nothing of processes: ranks.py starts them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from cloud_server.engine.static_llama import Layer, Linear, StaticLlama

Reduce = Callable[[torch.Tensor], torch.Tensor]


def fitting_sizes(config: Any) -> tuple[int, ...]:
    """The rank counts that split this model evenly: divisors of its attention heads, KV
    heads and MLP width (a KV head is never repeated over ranks)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return tuple(n for n in range(1, kv_heads + 1)
                 if heads % n == 0 and kv_heads % n == 0 and config.intermediate_size % n == 0)


def unfit(config: Any, ranks: int, devices: int | None) -> str | None:
    """Why `ranks` cannot hold this model, naming the counts that can; None when they can.
    `devices`: the CUDA devices present, None on the CPU (any number of processes)."""
    sizes = fitting_sizes(config)
    if devices is not None:
        sizes = tuple(n for n in sizes if n <= devices)
    named = " or ".join(str(n) for n in sizes)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if devices is not None and ranks > devices:
        return (f"--tensor-parallel {ranks} needs {ranks} GPUs, {devices} are present: "
                f"{named} would fit")
    if ranks not in fitting_sizes(config):
        return (f"--tensor-parallel {ranks} does not divide the model's {heads} attention heads, "
                f"{kv_heads} KV heads and MLP width {config.intermediate_size}: {named} would")
    return None


def all_reduce(group: Any) -> Reduce:
    """The sum over `group` (ranks.Group) of each rank's partial output, in place; it waits
    at most the group's timeout for the other ranks (ranks.py)."""
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        group.allreduce([partial]).wait()
        return partial
    return reduce


@torch.no_grad()
def shard(model: Any, rank: int, ranks: int, reduce: Reduce, device: torch.device
          ) -> StaticLlama:
    """Rank `rank`'s part of `model` on `device`: copies of its slices, so a rank that loaded
    the whole model can drop it (the modules compute as before: StaticLlama.of)."""
    whole = StaticLlama.of(model)
    H, G, hd = whole.heads, whole.kv_heads, whole.head_dim
    h, g = H // ranks, G // ranks

    def rows(weight: torch.Tensor | None, size: int, parts: tuple[int, ...]
             ) -> torch.Tensor | None:
        """This rank's slice of each stacked part (q | k | v, gate | up), of `size` rows a
        rank per unit of the part."""
        if weight is None:
            return None
        pieces, start = [], 0
        for units in parts:
            per = units * size // ranks
            pieces.append(weight[start + rank * per: start + (rank + 1) * per])
            start += units * size
        return torch.cat(pieces).to(device)

    def layer(full: Layer) -> Layer:
        inner = full.down.weight.shape[1]
        return replace(
            full, attn_norm=full.attn_norm.to(device), mlp_norm=full.mlp_norm.to(device),
            q_norm=None if full.q_norm is None else full.q_norm.to(device),
            k_norm=None if full.k_norm is None else full.k_norm.to(device),
            qkv=Linear(rows(full.qkv.weight, hd, (H, G, G)),  # type: ignore[arg-type]
                       rows(full.qkv.bias, hd, (H, G, G))),
            gate_up=Linear(rows(full.gate_up.weight, inner, (1, 1)),  # type: ignore[arg-type]
                           rows(full.gate_up.bias, inner, (1, 1))),
            o=_row_parallel(full.o, rank, ranks, device),
            down=_row_parallel(full.down, rank, ranks, device))

    embed = whole.embed.to(device)
    tied = whole.head.data_ptr() == whole.embed.data_ptr()
    head = embed if tied else (whole.head.to(device) if rank == 0
                               else whole.head.new_empty((0, whole.head.shape[1]), device=device))
    return replace(whole, embed=embed, head=head, norm=whole.norm.to(device),
                   inv_freq=whole.inv_freq.to(device), layers=tuple(map(layer, whole.layers)),
                   heads=h, kv_heads=g, reduce=reduce)


def _row_parallel(full: Linear, rank: int, ranks: int, device: torch.device) -> Linear:
    """This rank's columns of the input side; the bias is added once, by rank 0, before the
    sum."""
    per = full.weight.shape[1] // ranks
    weight = full.weight[:, rank * per: (rank + 1) * per].contiguous().to(device)
    bias = full.bias.to(device) if full.bias is not None and rank == 0 else None
    return Linear(weight, bias)

