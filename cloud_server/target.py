"""The target model: token ids in, logits out, with a KV cache per session.

Knows nothing of sessions, acceptance rules or gRPC. A draft tree is verified in one forward
pass: the pending token (committed but not yet in the cache) followed by the tree's nodes, under
a 4D ancestor mask with positions = base + depth (docs/architecture.md, Verification; SpecInfer, Miao et al. 2024,
section 4.2). Works for any transformers causal LM whose cache is a DynamicCache of full layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase,
)

from cloud_server.cpu_kernels import use_onednn_linear
from cloud_server.device import Device
from shared.errors import InvalidRequest
from shared.messages import ChatMessage
from shared.tree import DraftTree


def pick_device(device: Device) -> torch.device:
    if device is Device.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is Device.CUDA and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(device.value)


@dataclass
class TargetModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: torch.device

    @classmethod
    def load(cls, path: str, model_id: str, device: Device | str = Device.AUTO,
             onednn: bool = True) -> "TargetModel":
        """`device` may be given as text ("cpu"); `onednn`: on the CPU, run linear layers
        through oneDNN (cpu_kernels.py)."""
        dev = pick_device(Device(device))
        # fp32 on the CPU (bf16 matmuls are slow there); bf16 on a GPU.
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        # transformers wraps PreTrainedModel.to in a decorator whose stub loses the signature
        model = model.to(dev).eval()  # type: ignore[arg-type]
        if onednn and dev.type == "cpu":
            use_onednn_linear(model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, model_id, dev)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position costs in the KV cache: K and V of every layer's KV heads."""
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        element = next(self.model.parameters()).element_size()
        return c.num_hidden_layers * 2 * heads * head_dim * element

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)

    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(sorted(int(i) for i in ids if i is not None))

    def tokenizer_json(self) -> bytes:
        """The tokenizer in the `tokenizers` library format, for the edge."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise RuntimeError(f"{self.model_id} has no fast tokenizer to send to the edge")
        return backend.to_str().encode()

    def apply_chat_template(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"{self.model_id} has no chat template: send input_ids instead")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """Runs the prompt; returns its cache and the logits after the last token: [vocab]."""
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, n]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1].float()

    @torch.inference_mode()
    def forward_tree(self, cache: DynamicCache, pending: int, tree: DraftTree) -> torch.Tensor:
        """Appends [pending] + tree to the cache; returns logits: [1 + n, vocab].

        Row 0 is the target after the committed text, row i + 1 after draft node i.
        """
        base = cache.get_seq_length()
        ids = torch.tensor([(pending, *tree.tokens)], device=self.device)  # [1, 1 + n]
        positions = base + np.concatenate(([0], 1 + tree.depths()))  # [1 + n]
        out = self.model(
            input_ids=ids,
            attention_mask=self._tree_mask(base, tree),
            position_ids=torch.as_tensor(positions, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        return out.logits[0].float()

    def _tree_mask(self, base: int, tree: DraftTree) -> torch.Tensor:
        """Additive mask: [1, 1, 1 + n, base + 1 + n]; every row sees the cache and the pending
        token, a node sees itself and its ancestors only."""
        n = len(tree)
        allowed = np.zeros((1 + n, base + 1 + n), dtype=bool)
        allowed[:, : base + 1] = True
        allowed[1:, base + 1:] = tree.ancestor_mask()
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(torch.from_numpy(~allowed).to(self.device), torch.finfo(dtype).min)
        return mask[None, None]


@torch.inference_mode()
def keep_path(cache: DynamicCache, base: int, accepted_nodes: tuple[int, ...]) -> None:
    """Compacts the cache after a tree forward to the pending token plus the accepted path.

    The cache holds base + 1 + n entries; entry base + 1 + i belongs to draft node i. The
    accepted nodes move down to base + 1, base + 2, ... and everything after them is dropped.
    """
    src = torch.tensor([base + 1 + i for i in accepted_nodes], dtype=torch.long)
    new_len = base + 1 + len(accepted_nodes)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window KV layers cannot be compacted yet")
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [batch, kv_heads, seq, head_dim]
            if len(src):
                states[:, :, base + 1: new_len] = states[:, :, src.to(states.device)]
            setattr(layer, name, states[:, :, :new_len])
