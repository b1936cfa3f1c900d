"""Incremental detokenization and stop strings: output token ids → text, one token at a time.

DeepSeek's tokenizer is byte-level BPE, so the text of a run of ids is the concatenation of the texts of
its parts, except where a multi-byte UTF-8 character is split across tokens: such a split decodes to
U+FFFD. The detokenizer therefore decodes only the ids not yet committed and holds them back while their
text ends in U+FFFD (at most four tokens: one UTF-8 character has at most four bytes).

Stop strings (`find_stop`): the output ends before the first stop string that appears (after it, with
vLLM's ``include_stop_str_in_output``); text that could still be the start of a stop string is not reported
yet (`safe_length`), so a stream never shows a stop string or a part of one (unless it is to be kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "find_stop", "safe_length"]

_MAX_HELD_TOKENS = 4
"""A UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens (RFC 3629)."""


class _Decoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Text of a growing list of output ids.

    Args:
        tokenizer: anything with ``decode(ids, *, skip_special_tokens) -> str`` (`kvdiet.tokenizer.Tokenizer`).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: _Decoder, *, skip_special_tokens: bool = False) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._committed = 0  # ids whose text is in ``text``
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id; returns the text this id completed (possibly "", held back)."""
        self._ids.append(token_id)
        pending = self._ids[self._committed :]
        piece = self._tok.decode(pending, skip_special_tokens=self._skip)
        if piece.endswith("\ufffd") and len(pending) < _MAX_HELD_TOKENS:
            return ""
        self._committed = len(self._ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Commit held-back ids (at the end of a request); returns their text."""
        pending = self._ids[self._committed :]
        if not pending:
            return ""
        piece = self._tok.decode(pending, skip_special_tokens=self._skip)
        self._committed = len(self._ids)
        self.text += piece
        return piece


def find_stop(
    text: str, stops: Sequence[str], start: int = 0, *, include: bool = False
) -> tuple[int, str] | None:
    """Where the output in ``text`` ends on a stop string, searching from ``start`` (chars), and which stop
    string it is; None when no stop string is there. The index is where the earliest stop string begins (of
    those that begin at one place, the shortest), or with ``include`` (vLLM's ``include_stop_str_in_output``)
    where the first stop string to be complete ends (the earliest end: text past it would have been generated
    after the output stopped, so the result does not depend on how the text was split into tokens)."""
    hits = [(i, i + len(s), s) for s in stops if (i := text.find(s, start)) != -1]
    if not hits:
        return None
    if include:
        _, end, stop = min(hits, key=lambda hit: (hit[1], hit[0]))
        return end, stop
    begin, _, stop = min(hits)
    return begin, stop


def safe_length(text: str, stops: Sequence[str]) -> int:
    """Characters of ``text`` that can be reported now: everything except a tail that is a proper prefix
    of some stop string (it may yet become one)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
