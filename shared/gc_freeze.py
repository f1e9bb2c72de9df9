"""Keeps the cyclic garbage collector's full passes off the token path.

CPython's collector walks every tracked object in a full (generation 2) pass, and a process that
has loaded torch and transformers holds hundreds of thousands of them, all walked under the
interpreter lock. Such a pass comes every few hundred generations and stalls whatever runs then
for a few hundred milliseconds: the server's forward and its Verdicts, the edge's drafting and
its clock (results log, `latency_lazy_rows`). The loaded objects (modules, weights' wrappers,
the tokenizer, ONNX sessions) live as long as the process, so they are moved out of the
collector's reach once loading is done (gc.freeze); later passes walk only what serving
allocates, and take a few milliseconds.
"""
from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collects what loading left as garbage, then exempts every object alive now from later
    collections. Call once loading is done; calling it again freezes what was loaded since."""
    gc.collect()
    gc.freeze()
