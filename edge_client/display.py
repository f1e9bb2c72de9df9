"""What a person sees while an answer streams: committed text as it comes, offline drafts dimmed
until the server has judged them, link events on stderr.

Offline text is shown only on a terminal, where it can be taken back (cursor save/restore); a
pipe gets committed text only, so whatever reads it never sees text the target did not write.
"""
from __future__ import annotations

from typing import TextIO

from tokenizers import Tokenizer

from edge_client.tokenizer import TextStream

SAVE_CURSOR, RESTORE_AND_CLEAR = "\0337", "\0338\033[J"
DIM, PLAIN = "\033[2m", "\033[0m"


class TerminalView:
    def __init__(self, tokenizer: Tokenizer, out: TextIO, err: TextIO):
        self._tokenizer = tokenizer
        self._text = TextStream(tokenizer)
        self._out, self._err = out, err
        self._tty = out.isatty()
        self._offline: TextStream | None = None

    def committed(self, ids: list[int]) -> None:
        self._write(self._text.push(ids))

    def unverified(self, ids: list[int]) -> None:
        if not self._tty:
            return
        if self._offline is None:
            self._offline = TextStream(self._tokenizer)
            self._write(SAVE_CURSOR)
        self._write(DIM + self._offline.push(ids) + PLAIN)

    def withdraw(self) -> None:
        if self._offline is not None:
            self._write(RESTORE_AND_CLEAR)
            self._offline = None

    def link_event(self, text: str) -> None:
        self._err.write(f"\n[{text}]\n")
        self._err.flush()

    def kept_unverified(self, ids: list[int]) -> None:
        """The server never came back and the user keeps the offline text: a pipe gets it now
        (a terminal already shows it, dimmed)."""
        if not self._tty:
            self._write(self._tokenizer.decode(ids, skip_special_tokens=True))

    def _write(self, text: str) -> None:
        if text:
            self._out.write(text)
            self._out.flush()
