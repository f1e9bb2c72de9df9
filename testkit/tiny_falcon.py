"""The tiny Falcon drafter's parts on a prompt, for the tests that step it by hand: its edge
half, its server half and the activations the server half gives for the prompt."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.activations import ServerActivations
from cloud_server.moa.weights import load_drafter

PROMPT = [1, 46, 47, 48, 49]


def falcon_parts(tiny_target: Any, tiny_falcon_dir: Path) -> tuple[Any, Any, torch.Tensor]:
    config, server, edge = load_drafter(tiny_falcon_dir, tiny_target.model)
    assert config.block == 2 and server is not None
    activations = ServerActivations.load(tiny_falcon_dir, tiny_target.model)
    with torch.inference_mode(), LayerOutputs(tiny_target.model,
                                              activations.hidden_layers) as seen:
        tiny_target.model(input_ids=torch.tensor([PROMPT]))
        acts = server(seen.stacked()[0].float())  # [len(PROMPT), width]
    return edge, activations, acts
