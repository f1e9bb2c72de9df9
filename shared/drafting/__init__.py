"""The training-free drafters both sides run (the edge drafts with them; the server proposes
its own candidates with them), their interface (base.py) and the tree budget (budget.py);
here by name, for the CLIs and the factories."""
from __future__ import annotations

from shared.drafting.aded import AdedDrafter
from shared.drafting.base import Drafter, DrafterName
from shared.drafting.pld import PromptLookupDrafter

DRAFTERS: dict[DrafterName, type[AdedDrafter] | type[PromptLookupDrafter]] = {
    cls.name: cls for cls in (AdedDrafter, PromptLookupDrafter)}
# What a server drafts with itself (server-side speculation, its own candidates in paced
# sessions): these, and Token Recycling, which reads the target's logits
# (cloud_server/decoding/recycling.py).
SERVER_DRAFTERS = tuple(sorted([*DRAFTERS, DrafterName.RECYCLE]))


def make_drafter(name: DrafterName | str, depth_limit: int | None = None) -> Drafter:
    """A fresh training-free drafter. `depth_limit` is the deepest tree the server takes (its
    max_tree_depth): it lowers the drafter's own max_depth, never raises it."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose from: {', '.join(sorted(DRAFTERS))}")
    drafter = DRAFTERS[DrafterName(name)]()
    if depth_limit is not None:
        drafter.max_depth = min(drafter.max_depth, depth_limit)
    return drafter
