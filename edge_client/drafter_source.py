"""Which drafter object a generation uses: a training-free one by name, or the MoA drafter from
the bundle the server offers, fetched once and cached by sha256 (docs/architecture.md, Drafters).

Once cached, the bundle needs no server: the drafter keeps drafting offline with it.
"""
from __future__ import annotations

import contextlib
import sys
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator

from shared.drafting import DRAFTERS, make_drafter
from shared.drafting.base import Drafter, DrafterName, reads_activations
from edge_client.drafters import static_trees
from edge_client.drafters.moa_bundle import (
    bundle_cache_dir, find_bundle, install_bundle, load_manifest,
)
# onnxruntime loads only when one is built
from edge_client.drafters.trained import TREE_DRAFTERS, trained_drafter
from edge_client.drafters.tree_search import TreeSearch
from edge_client.link import LinkError, ServerLink
from shared.acceptance import AcceptanceMode
from shared.drafter_bundle import FALCON_ARTIFACT, MOA_ARTIFACT, BundleError
from shared.messages import ArtifactInfo, ArtifactKind, ServerInfo

FALLBACK = DrafterName.PLD  # what 'auto' drafts with when no trained drafter is offered
# the drafters that come as a bundle from the server, by the name Info lists it under
TRAINED = {DrafterName.MOA: MOA_ARTIFACT, DrafterName.FALCON: FALCON_ARTIFACT}


class TreeShape(Enum):
    """A trained drafter's tree: EAGLE-2's dynamic tree, or the static one designed for it and
    shipped in its bundle (static_trees.py). They tied (results log, `drafter_ablation_cddt`),
    so the dynamic tree, which follows each round's confidence, is the default."""

    DYNAMIC = "dynamic"
    DESIGNED = "designed"


def offered_drafter(info: ServerInfo) -> tuple[DrafterName, ArtifactInfo] | None:
    """The trained drafter the server offers (one at most), and its bundle artifact."""
    for artifact in info.artifacts:
        for name, artifact_name in TRAINED.items():
            if artifact.kind is ArtifactKind.DRAFTER_BUNDLE and artifact.name == artifact_name:
                return name, artifact
    return None


def resolve_drafter(name: DrafterName, info: ServerInfo) -> DrafterName:
    """'auto' is the trained drafter the server offers (MoA or Falcon: they measured best,
    results log `moa_tau_gpu`), else pld; any other name stays as it is."""
    if name is not DrafterName.AUTO:
        return name
    offered = offered_drafter(info)
    return offered[0] if offered else FALLBACK


def sampling_acceptance(name: DrafterName) -> AcceptanceMode:
    """The rule a drafter drafts best for under sampling (results log, `sampling`).
    'auto' has none until `resolve_drafter` names a drafter (EdgeClient.options)."""
    if name is DrafterName.AUTO:
        raise ValueError("'auto' names no drafter yet: build the request from the options of "
                         "an entered EdgeClient, which resolves it against the server")
    if name in TREE_DRAFTERS:
        return TREE_DRAFTERS[name].sampling_acceptance
    return DRAFTERS[name].sampling_acceptance


class DrafterPool:
    """Lends a drafter to each generation, as many at once as there are generations."""

    def __init__(self, make: Callable[[], Drafter], kept: Drafter | None = None):
        """Without `kept`, each generation gets a fresh drafter from `make` (training-free
        ones are cheap). `kept`: a drafter slow to build (a trained one's ONNX sessions),
        lent out and kept when it comes back; a generation beside another gets one from
        `make` (its sibling over the same sessions), also kept, so the pool holds as many as
        were ever in flight at once."""
        self._make = make
        self._keeps = kept is not None
        self._idle: list[Drafter] = [] if kept is None else [kept]
        self.needs_activations = reads_activations(kept)

    @contextlib.contextmanager
    def checkout(self) -> Iterator[Drafter]:
        drafter = self._idle.pop() if self._idle else self._make()
        try:
            yield drafter
        finally:
            if self._keeps:
                self._idle.append(drafter)


async def drafter_pool(name: DrafterName, link: ServerLink, info: ServerInfo,
                       draft_graphs: bool = False, race_aware: bool = False,
                       tree: TreeShape = TreeShape.DYNAMIC) -> DrafterPool:
    """`draft_graphs`: a trained drafter merges repeated tokens into draft graphs (GSD);
    `race_aware`: under exponential-race it ranks children by the session's race (ERSD);
    `tree`: its tree's shape."""
    if name not in TRAINED:
        if tree is TreeShape.DESIGNED:  # 'auto' found no trained drafter
            raise LinkError(f"the server ({info.model_id}) offers no trained drafter, and "
                            f"{name} has no designed tree: use --tree dynamic")
        return DrafterPool(lambda: make_drafter(name, depth_limit=info.limits.max_tree_depth))
    bundle_dir = await _trained_bundle(name, link, info)
    choices = designed_tree(name, bundle_dir) if tree is TreeShape.DESIGNED else None
    first = trained_drafter(bundle_dir, name, TreeSearch(merge=draft_graphs, choices=choices),
                            race_aware)
    return DrafterPool(first.sibling, kept=first)


def designed_tree(name: DrafterName, bundle_dir: Path) -> tuple[static_trees.Choice, ...]:
    """The designed tree the bundle carries; LinkError if it has none (the server decides what
    its drafter ships with)."""
    if not load_manifest(bundle_dir).designed_tree:
        raise LinkError(f"the server's {name} drafter comes without a designed tree: use "
                        "--tree dynamic, or serve a drafter with one (benchmarks/tree_design.py)")
    return static_trees.load(bundle_dir)


async def _trained_bundle(name: DrafterName, link: ServerLink, info: ServerInfo) -> Path:
    offered = offered_drafter(info)
    if offered is None:
        raise LinkError(f"the server ({info.model_id}) offers no trained drafter: use --drafter "
                        f"{' or '.join(sorted(DRAFTERS))}")
    if offered[0] is not name:
        raise LinkError(f"the server ({info.model_id}) offers the {offered[0]} drafter, not "
                        f"{name}: use --drafter {offered[0]} (or auto)")
    bundle = offered[1]
    cached = bundle_cache_dir(bundle.sha256)
    if cached.is_dir():
        return for_target(find_bundle(cached), info)
    print(f"fetching the {name} drafter ({bundle.size_bytes / 1e6:.1f} MB) from "
          f"{link.address}; it is cached for next time", file=sys.stderr, flush=True)
    try:
        data = await link.fetch_artifact(bundle.name, bundle.sha256, bundle.size_bytes)
    except LinkError as err:  # cut short, past its deadline: the text needs no drafter
        raise BundleError(f"the drafter bundle did not arrive whole ({err}); it is fetched "
                          "again next time") from None
    return for_target(install_bundle(data, bundle.sha256), info)


def for_target(bundle_dir: Path, info: ServerInfo) -> Path:
    """`bundle_dir`, if it was built for the server's target; BundleError if not (its
    activations and token ids would mean something else)."""
    built_for = load_manifest(bundle_dir).model_id
    if built_for != info.model_id:
        raise BundleError(f"the server's drafter bundle was built for {built_for}, not its "
                          f"target {info.model_id}: its operator should serve a drafter "
                          "trained for it")
    return bundle_dir
