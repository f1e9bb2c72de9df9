"""The server half in service: fresh activations of newly verified tokens.

Hook it right after verification. What it reads depends on the drafter (MoaConfig.server_input):
per-layer K/V, read from the cache once `keep_path` has compacted it to the committed text; or
chosen layers' outputs, which the session captures during the forward (`hidden_layers` says
which; cloud_server/engine/layer_outputs.py) for the same positions. Either way the rows are the
tokens the round verified: the previous pending token and the accepted drafts (the new bonus
token is not in the cache yet, so its activation comes with the next verdict); after the
prompt's prefill, [0, len(prompt)). Knows nothing of sessions or the wire: it returns an array,
fp16 by default (docs/protocol.md: 2 * width bytes a token).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cloud_server.moa.config import MoaConfig
from cloud_server.moa.model import layer_kv_from_cache
from cloud_server.moa.weights import load_drafter


class ServerActivations:
    def __init__(self, config: MoaConfig, server: torch.nn.Module) -> None:
        self.config, self.server = config, server.eval()

    @classmethod
    def load(cls, drafter_dir: Path, target: torch.nn.Module) -> "ServerActivations":
        config, server, _ = load_drafter(drafter_dir, target)
        if server is None:
            raise ValueError(f"the drafter in {drafter_dir} reads no activations: it has no "
                             "server half")
        return cls(config, server)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs a forward must capture for it; () reads the cache."""
        return self.config.hidden_layers

    @torch.inference_mode()
    def __call__(self, cache, start: int, end: int, hidden: torch.Tensor | None = None,
                 dtype: type = np.float16) -> np.ndarray:
        """activations: [end - start, width] of cache positions [start, end), batch row 0.
        hidden: [end - start, L, width], those positions' captured layer outputs, when the
        drafter reads them (`hidden_layers`); None otherwise."""
        if self.hidden_layers:
            if hidden is None or hidden.shape[0] != end - start:
                raise ValueError(f"the drafter reads layers {self.hidden_layers}: pass their "
                                 f"outputs for positions [{start}, {end})")
            inputs = hidden
        else:
            inputs = layer_kv_from_cache(cache, self.config.lsa_layers, start, end)
        return self.server(inputs.float()).cpu().numpy().astype(dtype)
