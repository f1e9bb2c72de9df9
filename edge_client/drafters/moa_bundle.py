"""The MoA drafter bundle on the edge: unpack a downloaded archive, check every sha256, cache it.

The archive is a tar of one directory (cloud_server/moa/bundle.py) whose bundle.json lists each
file's sha256; the archive's own sha256 is what the server announces. Nothing here runs a model.
"""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from shared.cache import cache_root

MANIFEST = "bundle.json"
BUNDLE_FORMAT = 1


class BundleError(ValueError):
    """A bundle that does not match its announced hash or its own manifest."""


def bundle_cache_dir(sha256: str) -> Path:
    return cache_root() / "drafters" / sha256


def install_bundle(data: bytes, sha256: str) -> Path:
    """Checks `data` against `sha256`, unpacks it into the cache (once) and returns the bundle
    directory."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BundleError("drafter bundle does not match its announced sha256")
    root = bundle_cache_dir(sha256)
    if root.is_dir():
        return find_bundle(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=".unpacking-"))
    try:
        _extract(data, staging)
        verify(find_bundle(staging))
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return find_bundle(root)


def find_bundle(root: Path) -> Path:
    """The one bundle directory under an unpacked archive."""
    found = [p.parent for p in root.glob(f"*/{MANIFEST}")]
    if len(found) != 1:
        raise BundleError(f"{root} holds {len(found)} bundles, expected 1")
    return found[0]


def load_manifest(bundle_dir: Path) -> dict:
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    if manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"drafter bundle format {manifest.get('format')} is not "
                          f"{BUNDLE_FORMAT}: update the edge client")
    return manifest


def verify(bundle_dir: Path) -> dict:
    """The manifest, after checking every listed file's sha256."""
    manifest = load_manifest(bundle_dir)
    for name, digest in manifest["files"].items():
        path = bundle_dir / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise BundleError(f"{name} in the drafter bundle is missing or corrupt")
    return manifest


def _extract(data: bytes, dest: Path) -> None:
    """Regular files one directory deep only: an archive cannot write outside `dest`."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 2 or ".." in parts or member.name[0] == "/":
                raise BundleError(f"unexpected entry {member.name!r} in the drafter bundle")
        tar.extractall(dest, filter="data")
