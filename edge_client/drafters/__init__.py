"""Drafters by name: the CLI's choices and the client's factory (DESIGN section 3)."""
from __future__ import annotations

from edge_client.drafters.aded import AdedDrafter
from edge_client.drafters.base import Drafter
from edge_client.drafters.pld import PromptLookupDrafter

DRAFTERS: dict[str, type] = {cls.name: cls for cls in (AdedDrafter, PromptLookupDrafter)}


def make_drafter(name: str, depth_limit: int | None = None) -> Drafter:
    """A fresh drafter. `depth_limit` is the deepest tree the server takes (its
    max_tree_depth): it lowers the drafter's own max_depth, never raises it."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose from: {', '.join(sorted(DRAFTERS))}")
    drafter = DRAFTERS[name]()
    if depth_limit is not None:
        drafter.max_depth = min(drafter.max_depth, depth_limit)
    return drafter
