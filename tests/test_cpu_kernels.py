"""oneDNN linear layers compute what PyTorch's default linear computes, up to float rounding."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cloud_server.cpu_kernels import onednn_available, use_onednn_linear


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_linear_matches_default(tiny_model_dir):
    stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    fast = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert use_onednn_linear(fast) == n_linear > 0
    ids = torch.tensor([[5, 17, 42, 99, 7, 61, 3, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, stock(ids).logits, atol=1e-4, rtol=1e-4)
