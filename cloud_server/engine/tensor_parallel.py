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


# A named weight's rows and (for a matrix) columns, as stored: the model's own parameters
# (`own_weights`), or a checkpoint's read a slice at a time (checkpoint_slices.py)
Read = Callable[[str, slice, slice], torch.Tensor]
ALL = slice(None)


def own_weights(model: Any) -> Read:
    """Reads `model`'s own parameters by name, detached: the shard's forward records nothing
    for autograd in any grad mode, as a graph capture runs it (StaticLlama.of)."""
    params = dict(model.named_parameters())

    def read(name: str, rows: slice, cols: slice) -> torch.Tensor:
        weight = params[name].detach()
        return weight[rows] if weight.dim() == 1 else weight[rows, cols]
    return read


def shard_names(model: Any) -> list[str]:
    """The names of the weights a shard reads (`shard`): every parameter, a tied head once,
    as a checkpoint stores them."""
    return [name for name, _ in model.named_parameters()]


@torch.no_grad()
def shard(model: Any, rank: int, ranks: int, reduce: Reduce, device: torch.device,
          read: Read | None = None) -> StaticLlama:
    """Rank `rank`'s part of `model` on `device`, each weight read as its slice alone
    (`read`, by default from `model`'s own parameters; `model` may then be a skeleton on
    the meta device that names them)."""
    read = read or own_weights(model)
    config, body, dtype = model.config, model.model, model.dtype
    names = {module: name for name, module in model.named_modules()}
    attn0 = body.layers[0].self_attn
    heads, hd = config.num_attention_heads, attn0.head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    h, g = heads // ranks, kv_heads // ranks

    def take(module: Any, rows: slice = ALL, cols: slice = ALL, what: str = "weight"
             ) -> torch.Tensor | None:
        if getattr(module, what, None) is None:
            return None
        return read(f"{names[module]}.{what}", rows, cols).to(device, dtype).contiguous()

    def mine(size: int) -> slice:
        """This rank's `size` of every ranks' x size."""
        return slice(rank * size, (rank + 1) * size)

    def stacked(*parts: tuple[Any, int]) -> Linear:
        """Column-parallel: this rank's rows of each module, stacked (q | k | v, gate | up)."""
        weights = [take(m, mine(size)) for m, size in parts]
        biases = [take(m, mine(size), what="bias") for m, size in parts]
        bias = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore
        return Linear(torch.cat(weights), bias)  # type: ignore[arg-type]

    def row_parallel(module: Any, size: int) -> Linear:
        """This rank's columns; the bias is added once, by rank 0, before the sum."""
        weight = take(module, cols=mine(size))
        assert weight is not None
        return Linear(weight, take(module, what="bias") if rank == 0 else None)

    def layer(block: Any) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        inner = mlp.down_proj.in_features // ranks
        return Layer(
            take(block.input_layernorm),  # type: ignore[arg-type]
            stacked((attn.q_proj, h * hd), (attn.k_proj, g * hd), (attn.v_proj, g * hd)),
            row_parallel(attn.o_proj, h * hd), take(getattr(attn, "q_norm", None)),
            take(getattr(attn, "k_norm", None)),
            take(block.post_attention_layernorm),  # type: ignore[arg-type]
            stacked((mlp.gate_proj, inner), (mlp.up_proj, inner)),
            row_parallel(mlp.down_proj, inner))

    embed = take(body.embed_tokens)
    assert embed is not None
    lm_head = model.get_output_embeddings()
    head = embed if _tied(model) else (take(lm_head) if rank == 0 else embed.new_empty(
        (0, embed.shape[1])))
    rotary = body.rotary_emb
    return StaticLlama(
        embed, tuple(map(layer, body.layers)), take(body.norm),  # type: ignore[arg-type]
        head, rotary.inv_freq.float().to(device),  # type: ignore[arg-type]
        float(getattr(rotary, "attention_scaling", 1.0)), float(config.rms_norm_eps), h, g, hd,
        float(attn0.scaling), reduce)


def _tied(model: Any) -> bool:
    """The head is the embedding (one parameter), as a checkpoint then stores it once."""
    return model.get_output_embeddings().weight is model.model.embed_tokens.weight
