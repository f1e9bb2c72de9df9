"""A Llama-family decoder as plain tensor math over static shapes: token ids in, hidden states
out, the KV written into preallocated slots (kv_slots.py) in place.

Knows nothing of sessions, trees or buckets: a forward is S rows of T tokens each, and
everything that varies between forwards (the ids, their RoPE positions, where each token's K/V
goes, which slot each row reads, how much of it is cached, the tree mask over the new tokens)
is a tensor input, so one shape can be captured once as a CUDA graph and replayed
(cuda_graphs.py; the style of gpt-fast's model.py). The context length `ctx` each row attends
over is the only number baked into a shape. The math is transformers' own, op for op (RMSNorm in
fp32, RoPE cos/sin in fp32 cast to the weights' dtype, SDPA with the module's scale), so it
agrees with the modules up to rounding. Fewer, larger ops where that is free: q, k and v are one
matmul, and so are gate and up; the modules' own weights become views of the fused ones, so the
model is held once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cloud_server.engine.session_mask import sliding_window

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def unsupported(model: Any) -> str | None:
    """Why the static engine cannot run `model` exactly, or None when it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"it runs {', '.join(sorted(FAMILIES))} models, not {config.model_type!r}"
    if sliding_window(config) is not None:
        return "it has no sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"it has no {config.hidden_act} activation"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope:
        return f"its RoPE is computed once, not per length ({rope!r})"
    return None


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module: Any) -> "Linear":
        bias = getattr(module, "bias", None)
        return cls(module.weight.detach(), None if bias is None else bias.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor  # [width]
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, width]
    o: Linear
    q_norm: torch.Tensor | None  # [head_dim], Qwen3
    k_norm: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, width]
    down: Linear


@dataclass(frozen=True)
class StaticLlama:
    """The weights and shape of one model, or of one rank's shard of it (tensor_parallel.py:
    `heads` and `kv_heads` are the heads it holds); `forward` is the math."""

    embed: torch.Tensor  # [vocab, width]
    layers: tuple[Layer, ...]
    norm: torch.Tensor  # [width]
    head: torch.Tensor  # [vocab, width]
    inv_freq: torch.Tensor  # [head_dim / 2], fp32
    rope_scale: float
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    # Sums a row-parallel layer's partial outputs over the ranks in place (tensor_parallel.py);
    # on one device the output is whole already
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda whole: whole

    @classmethod
    def of(cls, model: Any) -> "StaticLlama":
        """The model's weights, detached (the same storage): the forward records nothing for
        autograd and writes the KV slots in place in any grad mode, as a graph capture runs it."""
        config, body = model.config, model.model
        attn0 = body.layers[0].self_attn
        rotary = body.rotary_emb
        return cls(
            body.embed_tokens.weight.detach(), tuple(_layer(block) for block in body.layers),
            body.norm.weight.detach(), model.get_output_embeddings().weight.detach(),
            rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0)),
            float(config.rms_norm_eps), config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            attn0.head_dim, float(attn0.scaling))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, kv: torch.Tensor, ints: torch.Tensor, tree: torch.Tensor, ctx: int,
                capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of S rows x T tokens.

        kv: [2, layers, slots, kv_heads, positions, head_dim], written in place.
        ints: [4 * S * T + 2 * S] int64, packed (`pack`): ids, RoPE positions, the slot and
        position each token's K/V is written to, then per row the slot it reads and how many
        positions of it are cached. tree: [S, T, T] bool, what each new token sees of the
        row's new tokens. Returns the final-normed hidden states [S * T, width] and the
        captured layers' outputs [S * T, len(capture), width] (None for no capture).
        """
        S, T = tree.shape[0], tree.shape[1]
        ids, pos, write_slot, write_at = ints[: 4 * S * T].view(4, S, T)
        read_slot, cached = ints[4 * S * T:].view(2, S)
        x = F.embedding(ids.flatten(), self.embed)  # [S * T, width]: 2D, so linear is one mm
        cos, sin = self._rope(pos)  # [S, 1, T, head_dim]
        bias = self._mask(tree, cached, ctx)  # [S, 1, T, ctx]
        kept = []
        for i, layer in enumerate(self.layers):
            x = x + self.reduce(self._attend(
                layer, _rms(x, layer.attn_norm, self.eps).view(S, T, -1), cos, sin, kv[0, i],
                kv[1, i], write_slot, write_at, read_slot, bias, ctx))
            gate, up = layer.gate_up(_rms(x, layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            x = x + self.reduce(layer.down(F.silu(gate) * up))
            if i in capture:
                kept.append(x)
        final = _rms(x, self.norm, self.eps)
        if not capture:
            return final, None
        order = sorted(capture)
        return final, torch.stack([kept[order.index(i)] for i in capture], dim=1)

    def _attend(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, write_slot: torch.Tensor,
                write_at: torch.Tensor, read_slot: torch.Tensor, bias: torch.Tensor,
                ctx: int) -> torch.Tensor:
        """keys, values: one layer's slots [slots, kv_heads, positions, head_dim]."""
        S, T, _ = h.shape
        H, G = self.heads, self.kv_heads
        qkv = layer.qkv(h).view(S, T, H + 2 * G, self.head_dim)
        qk, v = qkv[:, :, : H + G], qkv[:, :, H + G:]
        if layer.q_norm is not None and layer.k_norm is not None:
            qk = torch.cat((_rms(qk[:, :, :H], layer.q_norm, self.eps),
                            _rms(qk[:, :, H:], layer.k_norm, self.eps)), dim=2)
        qk = _rotate(qk.transpose(1, 2), cos, sin)  # [S, heads + kv_heads, T, head_dim]
        q, k = qk[:, :H], qk[:, H:]
        heads = torch.arange(self.kv_heads, device=h.device)
        where = (write_slot[:, None, :], heads[None, :, None], write_at[:, None, :])
        keys.index_put_(where, k)
        values.index_put_(where, v.transpose(1, 2))
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :ctx][read_slot], values[:, :, :ctx][read_slot], attn_mask=bias,
            scale=self.scale, enable_gqa=self.heads != self.kv_heads)  # [S, heads, T, hd]
        return layer.o(out.transpose(1, 2).reshape(S * T, self.heads * self.head_dim))

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[..., None].float() * self.inv_freq  # [S, T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return ((angles.cos() * self.rope_scale).to(self.dtype),
                (angles.sin() * self.rope_scale).to(self.dtype))

    def _mask(self, tree: torch.Tensor, cached: torch.Tensor, ctx: int) -> torch.Tensor:
        """Additive [S, 1, T, ctx]: a row's cached positions, and of its new tokens (written
        at cached .. cached + T - 1) those `tree` allows. A pad token sees key 0 alone, so
        no row is empty; a finite minimum keeps any row from NaN."""
        S, T = tree.shape[0], tree.shape[1]
        key = torch.arange(ctx, device=tree.device)
        new = key[None, :] - cached[:, None]  # [S, ctx]: index among the new tokens
        inside = (new >= 0) & (new < T)
        seen = tree.gather(2, new.clamp(0, T - 1)[:, None, :].expand(S, T, ctx))
        allowed = (seen & inside[:, None, :]) | (key < cached[:, None])[:, None, :]
        allowed |= ~tree.any(-1)[:, :, None] & (key == 0)
        low = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=tree.device)
        return torch.where(allowed, zero, low)[:, None]


def pack(ids: torch.Tensor, pos: torch.Tensor, write_slot: torch.Tensor, write_at: torch.Tensor,
         read_slot: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """The integer inputs of `forward` as one array (one host-to-device copy)."""
    return torch.cat([ids.flatten(), pos.flatten(), write_slot.flatten(), write_at.flatten(),
                      read_slot, cached])


def _layer(block: Any) -> Layer:
    attn, mlp = block.self_attn, block.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return Layer(block.input_layernorm.weight.detach(),
                 _fused(attn.q_proj, attn.k_proj, attn.v_proj), Linear.of(attn.o_proj),
                 None if q_norm is None else q_norm.weight.detach(),
                 None if k_norm is None else k_norm.weight.detach(),
                 block.post_attention_layernorm.weight.detach(),
                 _fused(mlp.gate_proj, mlp.up_proj), Linear.of(mlp.down_proj))


@torch.no_grad()
def _fused(*modules: Any) -> Linear:
    """One Linear stacking the modules' outputs; each module's weight (and bias) becomes a view
    of the stacked one, so the modules compute as before and nothing is held twice."""
    weight = torch.cat([m.weight for m in modules])
    biases = [getattr(m, "bias", None) for m in modules]
    bias = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore[arg-type]
    sizes = [m.weight.shape[0] for m in modules]
    for m, part in zip(modules, weight.split(sizes)):
        m.weight = torch.nn.Parameter(part, requires_grad=False)
    if bias is not None:
        for m, part in zip(modules, bias.split(sizes)):
            m.bias = torch.nn.Parameter(part, requires_grad=False)
    return Linear(weight, bias)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalized in fp32, scaled in the input's dtype (torch's
    rms_norm is no single kernel on the CPU, and costs several times these few ops)."""
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin
