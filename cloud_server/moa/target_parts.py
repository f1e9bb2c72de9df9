"""What the MoA drafter takes from its target, read through the target's own transformers modules.

The edge half shares the target's ends: the embedding table as the target's embedding module
outputs it (Gemma's is scaled by sqrt(width) inside the module), the final RMSNorm's per-channel
weight as the norm applies it (Gemma's norm multiplies by 1 + weight), the LM head and the
final logits' soft-capping (Gemma 2). Its Self- and Cross-Attention blocks start from decoder
layers' weights under the drafter's names, fused projections (Phi-3's qkv_proj, gate_up_proj)
split. A target whose ends the drafter cannot reproduce is refused with one line naming the part.
Knows nothing of training, export or sessions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SharedEnds:
    """The target's frozen parts the edge half reuses, in fp32."""

    embedding: torch.Tensor  # [vocab, width]: the embedding module's output for each id
    final_norm: torch.Tensor  # [width]: w in norm(x) = x / rms(x) * w
    head: torch.Tensor  # [vocab, width]
    softcap: float  # final logits are cap * tanh(logits / cap); 0 for none


@torch.no_grad()
def shared_ends(target: Any) -> SharedEnds:
    """The ends of a transformers causal LM (tied or untied head)."""
    head = target.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(target).__name__}'s LM head has a bias: the drafter's head "
                         "has none")
    eps = float(target.config.rms_norm_eps)
    return SharedEnds(embedding_table(target.get_input_embeddings()),
                      rms_weight(target.model.norm, eps), head.weight.detach().float(),
                      float(getattr(target.config, "final_logit_softcapping", None) or 0.0))


@torch.no_grad()
def embedding_table(embed: Any) -> torch.Tensor:
    """What the embedding module outputs for every id: [vocab, width] fp32. Its weight itself
    where the module returns its rows as they are (in fp32 the target's storage, not a copy)."""
    weight = embed.weight  # [vocab, width]
    ids = torch.arange(weight.shape[0], device=weight.device)  # [vocab]
    if torch.equal(embed(ids[:8]), weight[:8]):
        return weight.detach().float()
    return embed(ids).float()


@torch.no_grad()
def rms_weight(norm: Any, eps: float) -> torch.Tensor:
    """w of an RMSNorm module, norm(x) = x / rms(x) * w: its `weight` (Llama) or 1 + weight
    (Gemma), told apart by running it on random rows; [width] fp32."""
    weight = norm.weight.detach().float()  # [width]
    rows = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0))
    rows = rows.to(weight.device)  # [4, width]
    got = norm(rows.to(norm.weight.dtype)).float()  # [4, width]
    unit = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)  # [4, width]
    for candidate in (weight, 1 + weight):
        if torch.allclose(got, unit * candidate, rtol=1e-2, atol=1e-3):  # bf16 rounding
            return candidate
    raise ValueError(f"the target's {type(norm).__name__} is not an RMSNorm x / rms(x) * w: "
                     "the drafter cannot share it")


def layer_weights(layer: Any, q_rows: int, kv_rows: int, eps: float) -> dict[str, torch.Tensor]:
    """A decoder layer's weights under the drafter Block's names: attn_norm, mlp_norm (the
    norms' effective weights), q/k/v/o_proj, gate/up/down_proj. `q_rows`, `kv_rows`: the rows
    of q_proj and of k_proj (heads * head_dim), where a fused qkv_proj is split."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj.weight.split([q_rows, kv_rows, kv_rows])
    else:
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    if hasattr(mlp, "gate_up_proj"):
        gate, up = mlp.gate_up_proj.weight.chunk(2)  # gate first, as Phi-3's MLP reads it
    else:
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    # Gemma 2/3 norm the MLP's input with pre_feedforward_layernorm; post_attention_layernorm
    # is then a post-norm, which the drafter's pre-norm block has no place for
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)
    return {"attn_norm": rms_weight(layer.input_layernorm, eps),
            "mlp_norm": rms_weight(mlp_norm, eps), "q_proj": q, "k_proj": k, "v_proj": v,
            "o_proj": attn.o_proj.weight, "gate_proj": gate, "up_proj": up,
            "down_proj": mlp.down_proj.weight}
