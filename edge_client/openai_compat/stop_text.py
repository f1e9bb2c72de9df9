"""OpenAI's stop semantics over a text stream: the answer ends before the first stop string.

The server ends a generation at the token that completes a stop string, so the committed text
holds it; OpenAI's API returns the text before it. While streaming, the last `longest - 1`
characters are held back, since they may be the start of a stop string.
"""
from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._text = ""
        self._sent = 0
        self._stopped = False

    def push(self, text: str) -> str:
        """The text that can be sent now that `text` was appended."""
        if self._stopped:
            return ""
        self._text += text
        cut = self._first_stop()
        if cut is not None:
            self._stopped = True
            return self._take(cut)
        return self._take(max(self._sent, len(self._text) - self._hold))

    def finish(self) -> str:
        """What is left to send at the end of the answer."""
        if self._stopped:
            return ""
        cut = self._first_stop()
        self._stopped = True
        return self._take(len(self._text) if cut is None else cut)

    def _first_stop(self) -> int | None:
        """Searched from what was sent: no stop string starts before it, since the last
        `longest - 1` characters were held back."""
        found = [i for i in (self._text.find(s, self._sent) for s in self._stops) if i >= 0]
        return min(found, default=None)

    def _take(self, end: int) -> str:
        out = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return out
