"""The trained drafters as the edge drafts with them: MoA or Falcon over the bundle's graphs,
prompt-lookup nodes merged into their trees, and, when asked, children ranked by the race.
Building one loads onnxruntime."""
from __future__ import annotations

from pathlib import Path

from edge_client.drafters.drafter_wrapper import PooledDrafter
from edge_client.drafters.falcon import FalconDrafter
from edge_client.drafters.lookup_merge import LookupMerge
from shared.drafting.pld import LOOKUP_NODES
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.race_aware import RaceAware
from edge_client.drafters.tree_drafter import TreeDrafter
from edge_client.drafters.tree_search import TreeSearch
from shared.drafter_bundle import Precision
from shared.drafting.base import DrafterName

TREE_DRAFTERS: dict[DrafterName, type[TreeDrafter]] = {
    DrafterName.MOA: MoaDrafter, DrafterName.FALCON: FalconDrafter}


def trained_drafter(bundle_dir: Path, name: DrafterName, search: TreeSearch = TreeSearch(),
                    race_aware: bool = False, precision: Precision | None = None,
                    lookup_nodes: int = LOOKUP_NODES) -> PooledDrafter:
    """Drafter `name` from its bundle; BundleError if the bundle is the other's. `race_aware`:
    under exponential-race its children are ranked by the session's race (ERSD)."""
    graphs = MoaGraphs(bundle_dir, precision)
    tree = TREE_DRAFTERS[name](graphs, search)
    return LookupMerge(RaceAware(tree, graphs.vocab) if race_aware else tree, lookup_nodes,
                       search.merge)
