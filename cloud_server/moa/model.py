"""The two halves of the Mixture-of-Attentions drafter (Zimmer et al., arXiv 2410.03804).

Knows nothing of training, sessions or the wire. Section 3 of the paper, split per docs/architecture.md, Drafters:

- `ServerHalf`: Layer Self-Attention (paper 3.1, "LSA") over one token's per-layer K and V of the
  target, treated as a sequence of `target_layers` entries, then a mean over layers and a
  projection to the target's width. Input: K and V rather than hidden states because after
  verification the server already holds exactly the committed tokens' K/V in its compacted
  cache (cloud_server/target.py keep_path): the activations cost no extra target work and no
  hooks, and the tree forward's K/V of an accepted node equal a causal forward's (a token's K/V
  depend on its ancestors only), so what the server computes matches what training saw.
- `HiddenFusion`, the server half for hidden-state inputs (`ServerInput.LAST_HIDDEN`,
  `FUSED_HIDDEN`): the outputs of chosen target layers (cloud_server/engine/layer_outputs.py), each
  RMS-normalised, concatenated and projected to the target's width by one linear layer, as
  EAGLE-3 fuses its low, middle and high features (Li et al. 2025, section 3.2). The last
  layer's output is the best next-token feature there is (EAGLE, Li et al. 2024, section 3) and
  is in no KV cache: the verification forward captures it for the accepted nodes.
- `EdgeHalf`: Self-Attention over the target's token embeddings (causal, or tree-masked while
  drafting), Cross-Attention (paper 3.2) whose keys and values come from the activations of
  verified positions only, then the target's final norm and LM head, frozen and shared.

RoPE: LSA uses positions 0..L-1 over layers with a full mask; SA and CA use absolute token
positions on both queries and memory keys, as in the paper's code.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.layers import Block, RMSNorm, Rotary
from cloud_server.moa.target_layers import TargetLayers
from cloud_server.moa.target_parts import SharedEnds, layer_weights, shared_ends


class ServerHalf(nn.Module):
    """Per-layer K/V of a token -> its activation: [n, L, target_kv_width] -> [n, width],
    L = len(config.lsa_layers) (the layers `layer_kv_from_cache` picks)."""

    layer_positions: torch.Tensor  # buffer: [L]

    def __init__(self, config: MoaConfig) -> None:
        super().__init__()
        c = config
        # Layers' K/V differ in scale by orders of magnitude; normalise before mixing them.
        self.in_norm = RMSNorm(c.target_kv_width, c.rms_eps)
        self.lsa = Block(c.target_kv_width, c.target_kv_width, c.lsa_heads, c.lsa_heads,
                         c.head_dim, c.lsa_intermediate, Rotary(c.head_dim, c.rope_theta),
                         c.rms_eps)
        self.proj = nn.Linear(c.target_kv_width, c.width)
        self.register_buffer("layer_positions", torch.arange(len(c.lsa_layers)),
                             persistent=False)

    def forward(self, layer_kv: torch.Tensor) -> torch.Tensor:
        """layer_kv: [..., L, target_kv_width] -> activations: [..., width]"""
        lead = layer_kv.shape[:-2]
        x = self.in_norm(layer_kv.flatten(0, -3))  # [n, L, kv_width]
        keys, values = self.lsa.attn.project_kv(self.lsa.attn_norm(x), self.layer_positions)
        x = self.lsa(x, self.layer_positions, keys, values, None)  # [n, L, kv_width]
        return self.proj(x.mean(1)).unflatten(0, lead)  # [..., width]


class HiddenFusion(nn.Module):
    """Chosen layers' outputs of a token -> its activation: [n, L, width] -> [n, width],
    L = len(config.hidden_layers). Starts as the mean of the normalised layers."""

    def __init__(self, config: MoaConfig) -> None:
        super().__init__()
        layers, width = len(config.hidden_layers), config.width
        self.eps = config.rms_eps
        self.norm_weight = nn.Parameter(torch.ones(layers, width))  # [L, width]
        self.proj = nn.Linear(layers * width, width)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(width).repeat(1, layers) / layers)
            self.proj.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., L, width] -> activations: [..., width]"""
        variance = hidden.pow(2).mean(-1, keepdim=True)  # [..., L, 1]
        x = hidden * torch.rsqrt(variance + self.eps) * self.norm_weight  # [..., L, width]
        return self.proj(x.flatten(-2))


def make_server_half(config: MoaConfig) -> nn.Module | None:
    """The server half that reads `config.server_input`; None for a drafter whose memory is not
    the target's activations (the Independent baseline)."""
    if not config.uses_activations:
        return None
    if config.server_input is ServerInput.LAYER_KV:
        return ServerHalf(config)
    return HiddenFusion(config)


class EdgeHalf(nn.Module):
    """Token ids + activation memory -> draft logits. The shared embedding, final norm and head
    are non-persistent buffers: frozen, and absent from `state_dict()` (the trained part only).

    With a sub-vocabulary (`config.draft_vocab`), `vocab_ids` [draft_vocab] lists the target
    token ids the head scores, in head-row order, and is saved with the trained part."""

    # buffers, shared with the target: [vocab, width], [width], [head_size], [head_size, width]
    embedding: torch.Tensor
    final_norm: torch.Tensor
    vocab_ids: torch.Tensor
    head: torch.Tensor

    def __init__(self, config: MoaConfig, ends: SharedEnds,
                 vocab_ids: torch.Tensor | None = None,
                 target_layers: TargetLayers | None = None) -> None:
        super().__init__()
        c = config
        if (target_layers is None) != (c.tli_layers == 0):
            raise ValueError(f"tli_layers {c.tli_layers}: pass the target's last layers "
                             "exactly when the config asks for them")
        self.tli = target_layers  # the target's last layers (TLI), frozen
        self.config = c
        self.softcap = ends.softcap
        rotary = Rotary(c.head_dim, c.rope_theta)
        self.sa = Block(c.width, c.width, c.heads, c.kv_heads, c.head_dim, c.intermediate,
                        rotary, c.rms_eps)
        self.memory_norm = RMSNorm(c.width, c.rms_eps)
        self.ca = Block(c.width, c.width, c.heads, c.kv_heads, c.head_dim, c.intermediate,
                        rotary, c.rms_eps)
        self.register_buffer("embedding", ends.embedding, persistent=False)  # [vocab, width]
        self.register_buffer("final_norm", ends.final_norm, persistent=False)  # [width]
        if vocab_ids is None:
            vocab_ids = torch.arange(c.vocab_size)
        if vocab_ids.shape != (c.head_size,):
            raise ValueError(f"vocab_ids has shape {tuple(vocab_ids.shape)}, the config "
                             f"asks for ({c.head_size},)")
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=bool(c.draft_vocab))
        head = ends.head[vocab_ids] if c.draft_vocab else ends.head
        self.register_buffer("head", head, persistent=False)  # [head_size, width]
        # recurrent: the previous position's feature joins each token's embedding; zero at
        # first, so training starts from the drafter without it
        self.feature_in = nn.Linear(c.width, c.width, bias=False) if c.recurrent else None
        if self.feature_in is not None:
            nn.init.zeros_(self.feature_in.weight)

    @classmethod
    def from_target(cls, config: MoaConfig, target: Any,
                    vocab_ids: torch.Tensor | None = None) -> "EdgeHalf":
        """Shares the embedding, final norm and LM head of a transformers causal LM, in fp32,
        and with `config.tli_layers` its last layers."""
        config.check_target(target.config)
        layers = None
        if config.tli_layers:
            layers = TargetLayers(target, config.tli_layers, config.heads, config.kv_heads,
                                  config.head_dim, config.rope_theta, config.rms_eps)
        return cls(config, shared_ends(target), vocab_ids, layers)

    @torch.no_grad()
    def init_from_target(self, target: Any) -> None:
        """Starts SA as a copy of the target's first layer and CA (all but its K/V projections,
        which read the activations, not the residual stream) as a copy of its last layer.

        For a Llama-shaped target SA over the token embeddings then computes exactly the
        target's first layer, and CA starts as a residual update the target's head already
        understands; training from there learned faster than from random weights on this CPU
        budget. What a Block has no place for (q/k/v biases, q/k norms, post-norms, another
        MLP activation) is left out: a start, not a copy."""
        layers = target.model.layers
        _copy_layer(self.sa, layers[0], with_kv=True)
        # with TLI the last layer it stands for is the one before the target's last N
        _copy_layer(self.ca, layers[len(layers) - 1 - self.config.tli_layers], with_kv=False)

    def memory_kv(self, activations: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """activations: [batch, m, width], positions: [m] -> CA keys, values:
        [batch, kv_heads, m, hd]. Computed once per verified token and kept by the edge."""
        return self.ca.attn.project_kv(self.memory_norm(activations), positions)

    def inputs(self, ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """ids: [batch, q], features: [batch, q, width] (the previous positions' features, for
        a recurrent drafter; None otherwise) -> the queries' input: [batch, q, width]"""
        x = self.embedding[ids]  # [batch, q, width]
        if self.feature_in is None:
            return x
        if features is None:
            raise ValueError("a recurrent drafter needs the previous positions' features")
        return x + self.feature_in(features)

    def sa_kv(self, ids: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: [batch, q] -> SA keys, values of these tokens: [batch, kv_heads, q, hd]
        (a drafter that is not recurrent)"""
        return self.sa_kv_of(self.inputs(ids, None), positions)

    def sa_kv_of(self, x: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [batch, q, width] from `inputs` -> SA keys, values: [batch, kv_heads, q, hd]"""
        return self.sa.attn.project_kv(self.sa.attn_norm(x), positions)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, sa_keys: torch.Tensor,
               sa_values: torch.Tensor, sa_mask: torch.Tensor, mem_keys: torch.Tensor,
               mem_values: torch.Tensor, ca_mask: torch.Tensor | None) -> torch.Tensor:
        """The normed output of q query tokens (a drafter that is not recurrent).

        ids, positions: [batch, q]/[q]; sa_keys, sa_values: [batch, kv_heads, p, hd] including
        the queries' own (from `sa_kv`); sa_mask: [batch or 1, 1, q, p] additive;
        mem_keys, mem_values: [batch, kv_heads, m, hd]; ca_mask: [batch or 1, 1, q, m] or None
        (every memory entry visible) -> [batch, q, width], the input of the LM head (a drafter
        without TLI, whose head reads its own output)."""
        if self.tli is not None:
            raise ValueError("a TLI drafter's queries need the target layers' K/V too")
        return self.normed(self.raw(self.inputs(ids, None), positions, sa_keys, sa_values,
                                    sa_mask, mem_keys, mem_values, ca_mask))

    def raw(self, x: torch.Tensor, positions: torch.Tensor, sa_keys: torch.Tensor,
            sa_values: torch.Tensor, sa_mask: torch.Tensor, mem_keys: torch.Tensor,
            mem_values: torch.Tensor, ca_mask: torch.Tensor | None) -> torch.Tensor:
        """The output before the final norm (what a recurrent drafter feeds back), from the
        queries' inputs x: [batch, q, width] -> [batch, q, width]"""
        h = self.sa(x, positions, sa_keys, sa_values, sa_mask)  # [batch, q, width]
        return self.ca(h, positions, mem_keys, mem_values, ca_mask)  # [batch, q, width]

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The target's final norm: [..., width] -> [..., width]"""
        variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1]
        return h * torch.rsqrt(variance + self.config.rms_eps) * self.final_norm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., width] -> [..., head_size]; column j scores token vocab_ids[j],
        soft-capped as the target caps its logits"""
        logits = hidden @ self.head.T  # [..., head_size]
        if not self.softcap:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def forward(self, ids: torch.Tensor, activations: torch.Tensor, sa_mask: torch.Tensor,
                ca_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: whole sequences at once. ids: [batch, T]; activations: [batch, T, width]
        of the same positions; sa_mask: [1, 1, T, T]; ca_mask: [batch, 1, T, T] (which
        positions' activations each query may see) -> the normed hidden state, the head's
        input, and the drafter's own output (with TLI the state it predicts for the target's
        layer L - N; else the last one, before the norm): [batch, T, width] each."""
        positions = torch.arange(ids.shape[1], device=ids.device)  # [T]
        x = self.inputs(ids, None)
        sa_keys, sa_values = self.sa_kv_of(x, positions)
        mem_keys, mem_values = self.memory_kv(activations, positions)
        own = self.raw(x, positions, sa_keys, sa_values, sa_mask, mem_keys, mem_values, ca_mask)
        last = own if self.tli is None else self.tli(own, positions, sa_mask)[0]
        return self.normed(last), own


def _copy_layer(block: Block, layer: Any, with_kv: bool) -> None:
    """Copies a transformers decoder layer's weights (target_parts.layer_weights) into a Block
    of equal sizes."""
    attn = block.attn
    theirs = layer_weights(layer, attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                           block.attn_norm.eps)
    mine = {"attn_norm": block.attn_norm.weight, "mlp_norm": block.mlp_norm.weight,
            "q_proj": attn.q_proj.weight, "o_proj": attn.o_proj.weight,
            "gate_proj": block.mlp.gate_proj.weight, "up_proj": block.mlp.up_proj.weight,
            "down_proj": block.mlp.down_proj.weight}
    if with_kv:
        mine |= {"k_proj": attn.k_proj.weight, "v_proj": attn.v_proj.weight}
    for name, tensor in mine.items():
        if tensor.shape != theirs[name].shape:
            raise ValueError(f"cannot start from the target's layer: {name} "
                             f"{tuple(tensor.shape)} vs {tuple(theirs[name].shape)}")
        tensor.copy_(theirs[name].float())


def layer_kv_from_cache(cache, layers: tuple[int, ...], start: int, end: int) -> torch.Tensor:
    """The LSA input of cache positions [start, end), batch row 0: [end - start, L, kv_width].

    `cache` is a transformers DynamicCache (one entry per layer with keys/values of shape
    [batch, kv_heads, seq, hd]); per chosen layer the token's K heads then V heads, flattened."""
    return torch.stack([_layer_kv(cache.layers[i].keys[:1], cache.layers[i].values[:1], start,
                                  end)[0] for i in layers], dim=1)


def _layer_kv(keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """keys, values: [batch, kv_heads, seq, hd] -> [batch, end - start, 2 * kv_heads * hd]"""
    k = keys[:, :, start:end].transpose(1, 2).flatten(-2)  # [batch, n, kv_heads * hd]
    v = values[:, :, start:end].transpose(1, 2).flatten(-2).to(k.dtype)  # the 4-bit engine's: double
    return torch.cat((k, v), dim=-1)


def batch_layer_kv(cache, layers: tuple[int, ...]) -> torch.Tensor:
    """All positions of a batched cache: [batch, seq, L, kv_width] (training)."""
    seq = cache.get_seq_length()
    return torch.stack([_layer_kv(cache.layers[i].keys, cache.layers[i].values, 0, seq)
                        for i in layers], dim=2)
