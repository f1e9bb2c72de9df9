"""Which drafter object a generation uses: a training-free one by name, or the MoA drafter from
the bundle the server offers, fetched once and cached by sha256 (docs/architecture.md, Drafters).

Once cached, the bundle needs no server: the drafter keeps drafting offline with it.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import AsyncIterator, Callable

from shared.drafting import DRAFTERS, make_drafter
from shared.drafting.base import Drafter, DrafterName
from edge_client.drafters.moa import MoaDrafter  # onnxruntime loads only when one is built
from edge_client.drafters.moa_bundle import bundle_cache_dir, find_bundle, install_bundle
from edge_client.link import LinkError, ServerLink
from shared.acceptance import AcceptanceMode
from shared.messages import ArtifactKind, ServerInfo

FALLBACK = DrafterName.PLD  # what 'auto' drafts with when the MoA drafter is not an option


def resolve_drafter(name: DrafterName, info: ServerInfo) -> DrafterName:
    """'auto' is the MoA drafter when the server offers one (it measured best: README), else
    pld; any other name stays as it is."""
    if name is not DrafterName.AUTO:
        return name
    offered = any(a.kind is ArtifactKind.DRAFTER_BUNDLE for a in info.artifacts)
    return DrafterName.MOA if offered else FALLBACK


def sampling_acceptance(name: DrafterName) -> AcceptanceMode:
    """The rule a drafter drafts best for under sampling (README, benchmarks/sampling.py).
    'auto' has none until `resolve_drafter` names a drafter (EdgeClient.options)."""
    if name is DrafterName.AUTO:
        raise ValueError("'auto' names no drafter yet: build the request from the options of "
                         "an entered EdgeClient, which resolves it against the server")
    if name is DrafterName.MOA:
        return MoaDrafter.sampling_acceptance
    return DRAFTERS[name].sampling_acceptance


class DrafterPool:
    """Lends a drafter to each generation. Training-free drafters are cheap and made fresh each
    time; the MoA drafter (ONNX sessions, slow to build) is built once and lent to one
    generation at a time."""

    def __init__(self, make: Callable[[], Drafter], shared: bool):
        self._make = make
        self._shared = make() if shared else None
        self._lock = asyncio.Lock()

    @property
    def needs_activations(self) -> bool:
        return self._shared is not None and self._shared.needs_activations

    @contextlib.asynccontextmanager
    async def checkout(self) -> AsyncIterator[Drafter]:
        if self._shared is None:
            yield self._make()
            return
        async with self._lock:
            yield self._shared


async def drafter_pool(name: DrafterName, link: ServerLink, info: ServerInfo,
                       draft_graphs: bool = False) -> DrafterPool:
    """`draft_graphs`: the MoA drafter merges repeated tokens into draft graphs (GSD)."""
    if name is not DrafterName.MOA:
        return DrafterPool(lambda: make_drafter(name, depth_limit=info.limits.max_tree_depth),
                           shared=False)
    bundle_dir = await _moa_bundle(link, info)
    return DrafterPool(lambda: MoaDrafter(bundle_dir, merge=draft_graphs), shared=True)


async def _moa_bundle(link: ServerLink, info: ServerInfo) -> Path:
    bundle = next((a for a in info.artifacts if a.kind is ArtifactKind.DRAFTER_BUNDLE), None)
    if bundle is None:
        raise LinkError(f"the server ({info.model_id}) offers no MoA drafter: use --drafter "
                        f"{' or '.join(sorted(DRAFTERS))}")
    cached = bundle_cache_dir(bundle.sha256)
    if cached.is_dir():
        return find_bundle(cached)
    print(f"fetching the MoA drafter ({bundle.size_bytes / 1e6:.1f} MB) from {link.address}; "
          "it is cached for next time", file=sys.stderr, flush=True)
    data = await link.fetch_artifact(bundle.name, bundle.sha256, bundle.size_bytes)
    return install_bundle(data, bundle.sha256)
