"""The files the server offers to edge devices (the tokenizer now), each with its sha256."""
from __future__ import annotations

import hashlib

from shared.messages import TOKENIZER_ARTIFACT, ArtifactInfo, ArtifactKind


class ArtifactStore:
    def __init__(self) -> None:
        self._items: dict[str, tuple[ArtifactInfo, bytes]] = {}

    def add(self, name: str, kind: ArtifactKind, data: bytes) -> ArtifactInfo:
        info = ArtifactInfo(name, kind, hashlib.sha256(data).hexdigest(), len(data))
        self._items[name] = (info, data)
        return info

    def get(self, name: str) -> tuple[ArtifactInfo, bytes] | None:
        return self._items.get(name)

    def tokenizer(self) -> ArtifactInfo:
        return self._items[TOKENIZER_ARTIFACT][0]

    def listing(self) -> tuple[ArtifactInfo, ...]:
        return tuple(info for info, _ in self._items.values())
