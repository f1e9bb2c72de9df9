"""The hidden states that chosen decoder layers of the target output during a forward pass.

A drafter fed by the target's hidden states (EAGLE's last-layer feature; EAGLE-3's fused low,
middle and high layers) needs them for exactly the tokens a forward verifies, and they are in no
KV cache. Forward hooks on the decoder layers capture them without a second pass and without
`output_hidden_states`, which would keep every layer's states of a whole prompt. Layer i's output
is the residual stream after layer i; the last layer's is the hidden state before the final
norm. Knows nothing of drafters or sessions: any transformers causal LM whose decoder layers are
`model.model.layers` (the Llama family and most others) works.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any

import torch


class LayerOutputs:
    """Use as a context manager around one forward; `stacked()` then gives the outputs."""

    def __init__(self, model: Any, layers: tuple[int, ...]) -> None:
        decoder_layers = model.model.layers
        if not layers or not all(0 <= i < len(decoder_layers) for i in layers):
            raise ValueError(f"layers {layers} are not among the target's "
                             f"{len(decoder_layers)} decoder layers")
        self._modules = [decoder_layers[i] for i in layers]
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "LayerOutputs":
        self._outputs.clear()
        for slot, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._keeper(slot)))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keeper(self, slot: int):
        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            # decoder layers return the hidden states, or a tuple led by them (older versions)
            self._outputs[slot] = output[0] if isinstance(output, tuple) else output
        return keep

    def stacked(self) -> torch.Tensor:
        """[batch, n, L, width] of the last forward, in the order the layers were given."""
        if len(self._outputs) != len(self._modules):
            raise RuntimeError("no forward ran inside the capture")
        return torch.stack([self._outputs[slot] for slot in range(len(self._modules))], dim=2)
