"""A lower bound on a text's token count, found without tokenizing it: the fewest steps that cover the text's UTF-8
bytes when a step from byte i may cover as many bytes as the longest vocabulary token whose first bytes (up to
`PREFIX_BYTES`) are the text's at i.

Why it holds: a byte-level BPE (GPT-2's byte map, as in DeepSeek's ``tokenizer.json``) hands its model every byte of
the text as one symbol, and every token it returns stands for the bytes of its symbols; added tokens stand for
their text. The ids of a text are then a cover of its bytes by token byte strings, end to end, each a token that
starts where the last one ended and matches the text there; its first `PREFIX_BYTES` bytes at least match, so it
is no longer than the longest token with those first bytes. The walk below takes any step up to that length, so it
needs no more steps than the tokenizer's ids. Hashing the prefixes into tables only merges entries (each keeps its
longest), which can lengthen a step and never shorten one.

What it buys: 30 MB of CJK without punctuation, or one 30 MB word, has no place where `kvdiet.tokenizer` may cut it
and took 30-50 s and 4-11 GB to tokenize before a prompt that long was refused; this bound finds more tokens than
any context holds in a second or two (`Tokenizer.least_tokens`), where ``bytes / longest token string`` (256: 128
spaces as two-byte symbols) found under 3% of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PREFIX_BYTES", "TokenCover", "longest_token_bytes", "plain_bpe"]

PREFIX_BYTES = 8
"""Bytes of a token's beginning the tables key on: two CJK characters and two bytes of a third, or eight ASCII
characters."""
_TABLE_BITS = 19  # slots a table (2^19 of 2 bytes: 1 MiB each, 8 MiB in all)
_CHUNK = 1 << 22  # text positions a pass (its working arrays some 200 MB)
_MUL = np.uint64(0x100000001B3)  # FNV-1's prime: the prefix key, a byte at a time
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the key's top bits index a table
_SHIFT = np.uint64(64 - _TABLE_BITS)


# pre-tokenizers that hand the model all of the text (split, or bytes mapped one to a symbol), so a token's string
# bounds the text it covers (`longest_token_bytes`)
_WHOLE_TEXT_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation"})


def plain_bpe(spec: dict[str, Any]) -> bool:
    """A BPE model that sees the text as written (no normalizer, or an empty sequence; no truncation), whose first
    symbols are the text's characters or bytes (no ``continuing_subword_prefix`` or ``end_of_word_suffix``: with
    them a character whose ``##c`` or ``c</w>`` is not in the vocabulary is dropped), with no added token that takes
    the spaces beside it (``lstrip``/``rstrip``)."""
    norm, model = spec.get("normalizer"), spec.get("model") or {}
    if norm is not None and norm != {"type": "Sequence", "normalizers": []}:
        return False
    if spec.get("truncation") is not None or model.get("type") != "BPE":
        return False
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    return not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])


def _nothing_dropped(spec: dict[str, Any]) -> bool:
    """Whether every character of a text reaches its ids (HF's BPE drops one it has no token for): the model has an
    ``<unk>`` for it, or the ``<0xXX>`` tokens of its bytes (byte fallback, all 256 in the vocabulary), or a
    ByteLevel pre-tokenizer writes the text as byte symbols, all 256 in the vocabulary."""
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("unk_token") is not None:
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    byte_level = any(step.get("type") == "ByteLevel" for step in _pre_tokenizers(spec))
    return byte_level and all(symbol in vocab for symbol in _byte_symbols())


def _pre_tokenizers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    pre = spec.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre] if pre else []


def longest_token_bytes(spec: dict[str, Any]) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, from a ``tokenizer.json``'s parsed JSON; None where no
    such bound holds.

    A bound holds for a plain BPE (`plain_bpe`) that drops no character (`_nothing_dropped`), has no fused
    ``<unk>`` and whose pre-tokenizers only split text or map its bytes one to a symbol (ByteLevel, Split, Digits,
    Metaspace, Punctuation, none of them ``Removed``): the text then reaches the model whole, and each token's
    vocabulary string (byte-level symbols, ``▁`` for a space, ``<0x0A>`` byte fallbacks: each at least as long in
    UTF-8 as the text it stands for), added token's content or
    ``<unk>`` (one character, 4 bytes at most) covers at most that many bytes. DeepSeek's file: 256 (128 spaces, as
    128 two-byte ``Ġ``). No bound where text can shrink or vanish before the model (a normalizer, a ``Removed``
    split, a character with no token and no ``<unk>``), where one token covers a run of any length (a fused
    ``<unk>``, an added token eating the spaces beside it), or where the file truncates.
    """
    model = spec.get("model") or {}
    if not plain_bpe(spec) or not _nothing_dropped(spec):
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk"):
        return None
    for step in _pre_tokenizers(spec):
        if step.get("type") not in _WHOLE_TEXT_PRE_TOKENIZERS or step.get("behavior") == "Removed":
            return None
    # an <unk> stands for one character: at most 4 bytes, as long as U+10FFFF in UTF-8
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    strings = [*model.get("vocab", {}), *added, "\U0010ffff"]
    return max((len(s.encode("utf-8", "surrogatepass")) for s in strings), default=0) or None


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte map, inverted: each of the 256 symbols a byte-level pre-tokenizer writes, to its byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


class TokenCover:
    """Tables of the longest token a run of first bytes can begin, from a ``tokenizer.json``'s parsed JSON.

    Build with `TokenCover.from_spec`, which gives None where the bound would not hold.
    """

    def __init__(self, tokens: list[bytes]) -> None:
        """``tokens``: the bytes every token (vocabulary and added) can stand for; all 256 single bytes among them.

        Raises:
            ValueError: a single byte no token stands for (a step could not cover it), or a token of more than
                65,535 bytes (the tables hold 16-bit lengths).
        """
        longest = max(map(len, tokens), default=0)
        if longest > 0xFFFF:
            raise ValueError(f"a token of {longest:,} bytes: the tables hold lengths up to 65,535")
        if len({t for t in tokens if len(t) == 1}) != 256:
            raise ValueError("not every byte is a token of its own: a step could not cover it")
        rows = np.zeros((len(tokens), PREFIX_BYTES), np.uint8)
        lengths = np.array([len(t) for t in tokens], np.int64)
        for i, token in enumerate(tokens):
            head = token[:PREFIX_BYTES]
            rows[i, : len(head)] = np.frombuffer(head, np.uint8)
        self._tables = np.zeros((PREFIX_BYTES, 1 << _TABLE_BITS), np.uint16)
        key = np.zeros(len(tokens), np.uint64)
        for k in range(PREFIX_BYTES):
            key = key * _MUL + rows[:, k].astype(np.uint64) + np.uint64(1)
            long_enough = lengths > k
            np.maximum.at(self._tables[k], (key[long_enough] * _MIX) >> _SHIFT, lengths[long_enough])

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> TokenCover | None:
        """The tables for a byte-level BPE whose ids always cover the text's bytes, else None.

        Holds for: a plain BPE (no normalizer or an empty sequence, no truncation, no added token that takes the
        spaces beside it) whose vocabulary has all 256 byte symbols and whose pre-tokenizer is a ByteLevel without
        ``add_prefix_space``, alone or last of a sequence of Split, Digits or Punctuation that remove nothing. A
        vocabulary string of other characters counts as its UTF-8 bytes (which can only lengthen a step).
        """
        if not plain_bpe(spec):  # (all 256 byte symbols, checked below: nothing is dropped)
            return None
        steps = _pre_tokenizers(spec)
        if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
            return None
        for step in steps[:-1]:
            if (
                step.get("type") not in ("Split", "Digits", "Punctuation")
                or step.get("behavior") == "Removed"
            ):
                return None
        symbols = _byte_symbols()
        vocab = (spec.get("model") or {}).get("vocab") or {}
        if not set(symbols) <= set(vocab):
            return None

        def as_bytes(string: str) -> bytes:
            if all(c in symbols for c in string):
                return bytes(symbols[c] for c in string)
            return string.encode("utf-8", "surrogatepass")

        added = [t.get("content", "").encode("utf-8") for t in spec.get("added_tokens") or []]
        tokens = [as_bytes(s) for s in vocab] + added
        return cls([t for t in tokens if t])

    def least_tokens(self, data: bytes, enough: int | None = None) -> int:
        """The fewest steps covering ``data`` (a text's UTF-8 bytes): no more than its token count.

        ``enough``: stop at the end of the 4 MiB piece of ``data`` in which the steps pass it (the count of the
        pieces so far, still a lower bound). Some 0.06 s a MB of text (numpy passes over it, a piece at a time) and
        0.25 s a million steps (Python's walk).
        """
        text = np.frombuffer(data, np.uint8)
        size = text.size
        steps = covered = farthest = 0  # bytes covered after `steps`; the farthest any seen position reaches
        for start in range(0, size, _CHUNK):
            end = min(size, start + _CHUNK)
            positions = np.arange(start, end, dtype=np.int64)
            reach = np.maximum.accumulate(positions + self._steps(text, start, end))
            reach = np.maximum(reach, farthest)
            farthest = int(reach[-1])
            ends = memoryview(reach)  # (indexed some 1.5x faster than the array)
            while covered < end:  # (covered >= start: each pass ends past its chunk)
                covered = ends[covered - start]
                steps += 1
            if enough is not None and steps > enough:
                return steps
        return steps

    def _steps(self, text: np.ndarray, start: int, end: int) -> np.ndarray:
        """The longest step from each position in [start, end): int64, at least 1, at most the bytes left.

        Over the prefix lengths k + 1 (k < `PREFIX_BYTES`), the least of: the longest token found for the text's
        first k + 1 bytes there, or k where none is. A token of L bytes that matches the text there counts toward
        every k < L (its first k + 1 bytes are the text's), and k >= L gives k or a token of more than k bytes: the
        least is never under L. Bytes past the text's end read as 0 (any length found there is cut to the bytes
        left)."""
        count = end - start
        window = np.zeros(count + PREFIX_BYTES, np.uint8)
        tail = text[start : end + PREFIX_BYTES]
        window[: tail.size] = tail
        key = np.zeros(count, np.uint64)
        step = np.full(count, 0xFFFF, np.int32)
        for k in range(PREFIX_BYTES):
            key *= _MUL
            key += window[k : k + count]
            key += np.uint64(1)
            longest = self._tables[k][(key * _MIX) >> _SHIFT].astype(np.int32)
            np.minimum(step, np.where(longest == 0, np.int32(k), longest), out=step)
        left = text.size - np.arange(start, end, dtype=np.int64)  # bytes from each position to the end
        return np.clip(step, 1, left)
