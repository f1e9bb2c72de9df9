"""The target's tokenizer on the edge: fetched from the server once, cached by sha256.

The edge needs it only to turn committed ids into text as they stream in; the server applies
the chat template and tokenizes prompts.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from edge_client.link import ServerLink
from shared.cache import cache_root
from shared.messages import TOKENIZER_ARTIFACT, ServerInfo


def tokenizer_cache_path(sha256: str) -> Path:
    return cache_root() / "tokenizers" / f"{sha256}.json"


async def load_tokenizer(link: ServerLink, info: ServerInfo) -> Tokenizer:
    """The tokenizer Info announces, from the local cache or downloaded into it."""
    path = tokenizer_cache_path(info.tokenizer_sha256)
    if not path.is_file():
        size = next((a.size_bytes for a in info.artifacts if a.name == TOKENIZER_ARTIFACT), 0)
        data = await link.fetch_artifact(TOKENIZER_ARTIFACT, info.tokenizer_sha256, size)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".part")
        staging.write_bytes(data)
        staging.replace(path)
    return Tokenizer.from_file(str(path))


class TextStream:
    """Incremental detokenization: the new text each time ids are appended.

    Holds back text ending in U+FFFD, the mark of a UTF-8 character split across tokens.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        new = text[self._emitted:]
        self._emitted = len(text)
        return new

    def flush(self) -> str:
        """Whatever push held back: the end of the stream has come, split character or not."""
        text = self.text()
        rest = text[self._emitted:]
        self._emitted = len(text)
        return rest

    def text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)
