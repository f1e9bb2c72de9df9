"""The trained drafter on disk: `moa.safetensors` (the trained part only: matrices in int8 with
one scale per row, the rest fp16) + `moa_config.json`.

The shared embedding, final norm and LM head are not saved: they are the target's, and are
attached again from the target model on load (docs/architecture.md, Drafters, keep the committed weights small).
Drafters trained for a target ship in `trained/<model id>/` (`committed_drafter`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cloud_server.moa.config import MoaConfig
from cloud_server.moa.model import EdgeHalf, make_server_half

WEIGHTS = "moa.safetensors"
CONFIG = "moa_config.json"
SCALE = ":scale"  # int8 matrix NAME's row scales are NAME + SCALE (no module key holds a ":")
TRAINED = Path(__file__).resolve().parent / "trained"  # committed drafters, one dir per model id


FALCON = "falcon"  # the committed Falcon drafter's directory inside a model's


def committed_drafter(model_id: str, falcon: bool = False) -> Path | None:
    """The MoA (or Falcon) drafter committed to the repo for a target model id, if any."""
    directory = TRAINED / model_id / (FALCON if falcon else "")
    return directory if (directory / WEIGHTS).is_file() else None


def save_weights(out: Path, config: MoaConfig, server: nn.Module | None,
                 edge: EdgeHalf) -> None:
    """`server` is None for a drafter whose memory is not the target's activations."""
    modules = (("server", server), ("edge", edge)) if server else (("edge", edge),)
    tensors = {name: stored for prefix, module in modules
               for k, v in module.state_dict().items()
               for name, stored in _compact(f"{prefix}.{k}", v).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS)
    config.save(out / CONFIG)


def load_drafter(directory: Path,
                 target: torch.nn.Module) -> tuple[MoaConfig, nn.Module | None, EdgeHalf]:
    """Both halves in fp32 on the target's device, eval mode, edge half sharing the target's
    embedding, final norm and head. The server half is None when the drafter's memory is not
    the target's activations (the Independent baseline)."""
    config = MoaConfig.load(directory / CONFIG)
    tensors = _expand(load_file(directory / WEIGHTS))
    device = next(target.parameters()).device
    server = make_server_half(config)
    edge = EdgeHalf.from_target(config, target, tensors.get("edge.vocab_ids"))
    for prefix, module in (("server.", server), ("edge.", edge)):
        if module is None:
            continue
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict(state)
    return config, server.to(device).eval() if server else None, edge.to(device).eval()


def _compact(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A matrix as int8 with one fp32 scale per row (symmetric, the row's largest magnitude at
    127), half fp16's bytes, so the committed drafters fit the tree's size budget
    (tests/test_tree_size.py); the target verifies every draft, so the rounding could cost tau
    (none measured: results log, `moa_tau_weights_int8`), never the text. Vectors fp16, index
    tensors (the sub-vocabulary) as they are."""
    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        return {name: tensor.contiguous()}
    if tensor.dim() != 2 or tensor.shape[0] == 1:
        return {name: tensor.half().contiguous()}
    weight = tensor.float()  # [rows, columns]
    scale = weight.abs().amax(dim=1) / 127  # [rows]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {name: quantized.contiguous(), name + SCALE: scale.contiguous()}


def _expand(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 tensors from what `_compact` wrote (and from the fp16 files written before it);
    index tensors as they are."""
    tensors = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE):
            continue
        if name + SCALE in stored:
            tensors[name] = tensor.float() * stored[name + SCALE][:, None].float()
        else:
            tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return tensors
