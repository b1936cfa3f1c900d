"""Incremental detokenization over byte-level tokens (split UTF-8 characters held back) and stop strings."""

from __future__ import annotations

from kvdiet.engine.detokenizer import IncrementalDetokenizer, find_stop, safe_length


class ByteTokenizer:
    """Id = one byte; text = the bytes decoded as UTF-8 with replacement (like a byte-level BPE)."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_split_characters_are_held_until_complete() -> None:
    d = IncrementalDetokenizer(ByteTokenizer())
    pieces = [d.add(b) for b in "aé€😀z".encode()]
    assert "".join(pieces) == d.text == "aé€😀z"
    assert pieces[1] == "" and pieces[2] == "é"  # é = 2 bytes: nothing after the first
    assert pieces[-2] == "😀" and pieces[-5:-2] == ["", "", ""]


def test_invalid_bytes_are_released_after_four_tokens_and_at_the_end() -> None:
    d = IncrementalDetokenizer(ByteTokenizer())
    out = [d.add(0xFF) for _ in range(4)]
    assert out[:3] == ["", "", ""] and out[3] == "\ufffd" * 4  # never held past one character's length
    d.add(0xC3)
    assert d.flush() == "\ufffd" and d.text.endswith("\ufffd")
    assert d.flush() == ""


def test_find_stop_takes_the_earliest_stop() -> None:
    assert find_stop("hello world", ["world", "lo"]) == (3, "lo")
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("abcabc", ["abc"], start=1) == (3, "abc")


def test_find_stop_with_include_ends_after_the_stop_string() -> None:
    assert find_stop("hello world", ["world", "lo"], include=True) == (5, "lo")  # "lo" begins first
    assert find_stop("xabcd", ["abc", "ab"], include=True) == (3, "ab")  # same start: the shorter came first
    assert find_stop("xabcd", ["abc", "ab"]) == (1, "ab")
    assert find_stop("hello", ["xyz"], include=True) is None
    # one token "xabc" or four: the output is the same, "xab" ("b" is complete before "abc" is)
    assert find_stop("xabc", ["abc", "b"], include=True) == (3, "b")
    assert find_stop("xab", ["abc", "b"], include=True) == (3, "b")
    assert find_stop("xabcd", ["abcd", "c"], include=True) == (4, "c")


def test_safe_length_holds_a_possible_stop_prefix() -> None:
    assert safe_length("hello wo", ["world"]) == 6
    assert safe_length("hello", ["world"]) == 5
    assert safe_length("ab", ["abc", "bx"]) == 0  # "ab" may become "abc"
    assert safe_length("text", []) == 4
