"""oneDNN linear layers with packed weights compute what PyTorch's default linear computes, up to
float rounding, for every row count (fewer than MIN_ROWS rows are padded)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cloud_server.engine.cpu_kernels import MIN_ROWS, onednn_available, use_onednn_linear

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def test_onednn_linear_matches_default(tiny_model_dir):
    stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    fast = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert use_onednn_linear(fast) == n_linear > 0
    ids = torch.tensor([[5, 17, 42, 99, 7, 61, 3, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, stock(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 0), (1, 1), (1, 2), (2, 1), (1, MIN_ROWS), (1, 7), (3, 5)])
def test_packed_linear_any_rows(shape):
    layer = torch.nn.Linear(24, 40)
    expected_layer = torch.nn.Linear(24, 40)
    expected_layer.load_state_dict(layer.state_dict())
    assert use_onednn_linear(layer) == 1
    x = torch.randn(*shape, 24, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = layer(x)
        torch.testing.assert_close(out, expected_layer(x), atol=1e-5, rtol=1e-5)
    assert out.shape == (*shape, 40)
