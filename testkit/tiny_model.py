"""A tiny random-weight Llama with a byte-level tokenizer, saved like any local checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerFast)

SPECIALS = ["<unk>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>",
                                  eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Writes a 2-layer Llama (vocab 320, width 64) and its tokenizer to `path`."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    return save_sharpened(LlamaForCausalLM(config), path)


def sharpen(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its matrices scaled up: larger weights give peaked, varied next-token
    distributions, whose top two logits are rarely within rounding of each other."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    return model


def save_sharpened(model: PreTrainedModel, path: Path) -> Path:
    """Writes `model`, sharpened, and the byte-level tokenizer to `path`."""
    sharpen(model).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
