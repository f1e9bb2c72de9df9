"""Where the tests run the target: the CPU, or the device named by SPLITDEC_TEST_DEVICE.

On a GPU node, `SPLITDEC_TEST_DEVICE=cuda` runs the same equivalence tests (batched sessions
against each alone, split and server-side speculation against plain greedy decoding, the
precisions of `--dtype`) on CUDA: docs/usage.md, "On a GPU node". CI runs them on the CPU.
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("SPLITDEC_TEST_DEVICE", "cpu")
