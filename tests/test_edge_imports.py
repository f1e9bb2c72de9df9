"""The edge install has no torch: importing the edge client must not pull it in."""
from __future__ import annotations

import subprocess
import sys

EDGE_MODULES = ["edge_client.cli", "edge_client.client", "edge_client.batch_mode",
                "edge_client.generate", "edge_client.link", "edge_client.drafters",
                "edge_client.server_only", "edge_client.openai_compat.app",
                "edge_client.openai_compat.serving", "netsim", "netsim.cli"]


def test_edge_client_does_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in EDGE_MODULES)
            + "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            + "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
