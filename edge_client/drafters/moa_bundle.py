"""The MoA drafter bundle on the edge: unpack a downloaded archive, check every sha256, cache it.

The archive is a tar of one directory (cloud_server/moa/bundle.py) whose bundle.json lists each
file's sha256; the archive's own sha256 is what the server announces. Nothing here runs a model.
"""
from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

from shared.cache import cache_root
from shared.drafter_bundle import MANIFEST_NAME, BundleError, BundleManifest


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
    found = [p.parent for p in root.glob(f"*/{MANIFEST_NAME}")]
    if len(found) != 1:
        raise BundleError(f"{root} holds {len(found)} bundles, expected 1")
    return found[0]


def load_manifest(bundle_dir: Path) -> BundleManifest:
    return BundleManifest.from_json((bundle_dir / MANIFEST_NAME).read_text())


def verify(bundle_dir: Path) -> BundleManifest:
    """The manifest, after checking every listed file's sha256."""
    manifest = load_manifest(bundle_dir)
    for name, digest in manifest.files.items():
        path = bundle_dir / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise BundleError(f"{name} in the drafter bundle is missing or corrupt")
    return manifest


def _extract(data: bytes, dest: Path) -> None:
    """Regular files one directory deep only, their bytes and nothing of their metadata: an
    archive cannot write outside `dest` (tarfile's extraction filters need Python 3.11.4;
    Debian bookworm's is 3.11.2)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        for member in members:
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) != 2 or ".." in parts or member.name[0] == "/":
                raise BundleError(f"unexpected entry {member.name!r} in the drafter bundle")
        for member in members:
            content = tar.extractfile(member)
            assert content is not None  # a regular file, checked above
            path = dest / member.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.read())
