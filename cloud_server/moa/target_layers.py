"""Target Layer Inference (Zimmer et al., arXiv 2410.03804, section 3.3): the target's own last
layers, run on the edge after the drafter's.

The drafter's output is read as the target's hidden state after layer L - N - 1 (0-based) and
the target's last N decoder layers, frozen, take it to the final norm and head, so the drafter
learns to predict a state the target still refines rather than the last one. Each layer keeps
its own K/V per position, beside the drafter's Self-Attention cache.

The layers are copied into the drafter's plain pre-norm `Block` (what the ONNX export traces);
a copy is used only if it computes what the target's layer computes, checked on random input
at build time. Layers with parts a Block lacks (biases, q/k norms, post-norms, scaled RoPE)
are refused with the layer and the difference named, as are sliding-window layers. The
weights are non-persistent buffers: the target's, attached again at load, never saved with
the drafter or trained.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloud_server.moa.layers import Block, Rotary, additive_mask
from cloud_server.moa.target_parts import layer_weights
from cloud_server.engine.session_mask import sliding_window

TOLERANCE = 1e-3  # relative: a Block that computes the target's layer differs by rounding only


class TargetLayers(nn.Module):
    """The target's last `count` layers: [batch, q, width] -> [batch, q, width]."""

    def __init__(self, target: Any, count: int, heads: int, kv_heads: int, head_dim: int,
                 theta: float, eps: float) -> None:
        super().__init__()
        layers = list(target.model.layers)
        if not 0 < count < len(layers):
            raise ValueError(f"tli_layers {count}: the target has {len(layers)} layers")
        width = target.config.hidden_size
        rotary = Rotary(head_dim, theta)
        self.first = len(layers) - count  # the first target layer this runs
        blocks = []
        for index in range(self.first, len(layers)):
            _refuse_window(target.config, index)
            block = Block(width, width, heads, kv_heads, head_dim,
                          target.config.intermediate_size, rotary, eps)
            _copy_frozen(block, layers[index], eps)
            _check_exact(block, layers[index], target, index)
            blocks.append(block)
        self.blocks: list[Block] = nn.ModuleList(blocks)  # type: ignore[assignment]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past_keys: torch.Tensor | None = None,
                past_values: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [batch, q, width], the drafter's output at q query positions; mask: additive
        [batch or 1, 1, q, p + q]; past_keys, past_values: [batch, count * kv_heads, p, hd],
        each layer's heads in turn (None: p = 0) -> the last layer's output [batch, q, width]
        and the queries' own K/V, laid out as the past: [batch, count * kv_heads, q, hd]."""
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            k, v = block.attn.project_kv(block.attn_norm(h), positions)  # [b, kvh, q, hd]
            keys.append(k)
            values.append(v)
            if past_keys is not None and past_values is not None:
                heads = slice(i * k.shape[1], (i + 1) * k.shape[1])
                k = torch.cat((past_keys[:, heads], k), dim=2)
                v = torch.cat((past_values[:, heads], v), dim=2)
            h = block(h, positions, k, v, mask)
        return h, torch.cat(keys, 1), torch.cat(values, 1)


def _refuse_window(config: Any, index: int) -> None:
    """A sliding-window layer sees only the last `window` keys; the edge's copy sees all."""
    window = sliding_window(config)
    types = getattr(config, "layer_types", None)
    if window is not None and (types is None or types[index] == "sliding_attention"):
        raise ValueError(f"tli_layers: the target's layer {index} attends over a sliding window "
                         f"of {window}, which the edge's copy does not apply: train without TLI")


@torch.no_grad()
def _copy_frozen(block: Block, layer: Any, eps: float) -> None:
    """The layer's weights into `block`, each parameter turned into a non-persistent buffer."""
    attn = block.attn
    weights = layer_weights(layer, attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                            eps)
    owners: dict[str, nn.Module] = {"attn_norm": block.attn_norm, "mlp_norm": block.mlp_norm, "q_proj": attn.q_proj,
              "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
              "gate_proj": block.mlp.gate_proj, "up_proj": block.mlp.up_proj,
              "down_proj": block.mlp.down_proj}
    for name, owner in owners.items():
        weight, mine = weights[name].detach().float(), owner.get_parameter("weight")
        if weight.shape != mine.shape:
            raise ValueError(f"tli_layers: the target layer's {name} is "
                             f"{tuple(weight.shape)}, the drafter's block "
                             f"{tuple(mine.shape)}")
        del owner.weight
        owner.register_buffer("weight", weight.clone(), persistent=False)


@torch.no_grad()
def _check_exact(block: Block, layer: Any, target: Any, index: int) -> None:
    """Runs the copy and the target's layer on the same random positions (causal) and refuses
    a copy that differs by more than rounding."""
    device = next(layer.parameters()).device
    dtype = next(layer.parameters()).dtype
    width, length = target.config.hidden_size, 6
    x = torch.randn(1, length, width, generator=torch.Generator().manual_seed(index))
    positions = torch.arange(3, 3 + length)
    mask = additive_mask(torch.ones(length, length, dtype=torch.bool).tril())[None, None]
    keys, values = block.attn.project_kv(block.attn_norm(x), positions)
    mine = block(x, positions, keys, values, mask)
    try:
        theirs = _run_layer(layer, target, x.to(device, dtype), positions.to(device),
                            mask.to(device, dtype)).float().cpu()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"tli_layers: the target's layer {index} ({type(layer).__name__}) "
                         f"does not run alone as a Llama layer does ({err}): train without "
                         "TLI") from None
    error = ((mine - theirs).norm() / theirs.norm()).item()
    if not error < max(TOLERANCE, 10 * torch.finfo(dtype).eps):
        raise ValueError(f"tli_layers: the target's layer {index} "
                         f"({type(layer).__name__}) is not a plain pre-norm block the edge "
                         f"can run (relative difference {error:.2g}): train without TLI")


def _run_layer(layer: Any, target: Any, x: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """The target's decoder layer alone, with its model's rotary embedding."""
    position_ids = positions[None]
    embeddings = target.model.rotary_emb(x, position_ids)
    out = layer(x, attention_mask=mask, position_ids=position_ids,
                position_embeddings=embeddings)
    return out[0] if isinstance(out, tuple) else out
