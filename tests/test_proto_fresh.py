"""The committed stubs are exactly what proto/ generates: editing a .proto needs `make proto`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gen_proto  # noqa: E402

GENERATED = Path("shared/pb/splitdec/v1")


def test_committed_stubs_match_proto(tmp_path):
    gen_proto.generate(tmp_path)
    fresh = sorted((tmp_path / GENERATED).glob("*.py*"))
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = gen_proto.ROOT / GENERATED / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: make proto"
