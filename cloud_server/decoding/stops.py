"""What ends a generation before its token budget: a stop token, or a stop string in its text.

Admission asks it whether a resumed history has already ended; the session asks it which of a
round's tokens ends the generation. Knows nothing of the model beyond its tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from shared.messages import FinishReason


@dataclass(frozen=True)
class StopRule:
    token_ids: frozenset[int]
    strings: tuple[str, ...]
    tokenizer: PreTrainedTokenizerBase = field(compare=False, repr=False)

    def first_stop(self, tokens: Sequence[int], generated: Sequence[int] = ()
                   ) -> tuple[int, FinishReason] | None:
        """The index of the first of `tokens` that would end a generation that has produced
        `generated`, and why. A stop string ends it at the token that completes it, as the user
        would read the text (no special tokens)."""
        prefix = list(generated)
        strings = bool(self.strings) and self._has_string(prefix + list(tokens))
        for i, token in enumerate(tokens):
            if token in self.token_ids:
                return i, FinishReason.STOP_TOKEN
            if strings and self._has_string(prefix + list(tokens[: i + 1])):
                return i, FinishReason.STOP_STRING
        return None

    def _has_string(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)
