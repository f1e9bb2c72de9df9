"""The server half in service: fresh activations of newly verified tokens, read from the cache.

Hook it right after verification: once `keep_path` has compacted the cache to the committed
text, cache positions [start, end) are the tokens that this round verified (the previous pending
token and the accepted drafts; the new bonus token is not in the cache yet, so its activation
comes with the next verdict). After the prompt's prefill, [0, len(prompt)). Knows nothing of
sessions or the wire: it returns an array, fp16 by default (docs/protocol.md: 2 * width bytes a token).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cloud_server.moa.config import MoaConfig
from cloud_server.moa.model import ServerHalf, layer_kv_from_cache
from cloud_server.moa.weights import load_drafter


class ServerActivations:
    def __init__(self, config: MoaConfig, server: ServerHalf) -> None:
        self.config, self.server = config, server.eval()

    @classmethod
    def load(cls, drafter_dir: Path, target: torch.nn.Module) -> "ServerActivations":
        config, server, _ = load_drafter(drafter_dir, target)
        if server is None:
            raise ValueError(f"the drafter in {drafter_dir} reads no activations: it has no "
                             "server half")
        return cls(config, server)

    @torch.inference_mode()
    def __call__(self, cache, start: int, end: int, dtype: type = np.float16) -> np.ndarray:
        """activations: [end - start, width] of cache positions [start, end), batch row 0."""
        layer_kv = layer_kv_from_cache(cache, self.config.lsa_layers, start, end)
        return self.server(layer_kv.float()).cpu().numpy().astype(dtype)
