"""Regenerates the committed gRPC stubs from proto/ (run `make proto` after editing a .proto).

protoc's `-I<virtual>=<dir>` maps proto/ onto the import path `shared/pb`, so the generated
modules import each other as `shared.pb.splitdec.v1...` and need no sys.path tricks.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
VIRTUAL_ROOT = "shared/pb"


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))


def generate(out_root: Path) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{VIRTUAL_ROOT}={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[f"{VIRTUAL_ROOT}/{name}" for name in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write shared/pb/... under")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
