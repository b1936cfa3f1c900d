"""Token-count and byte-size parsing."""

from __future__ import annotations

import argparse

import pytest

from kvdiet import units
from kvdiet.units import format_bytes, format_count, format_tokens, parse_bytes, parse_count


def test_parse() -> None:
    assert parse_count("128K") == 128_000
    assert parse_count("1Mi") == 1_048_576
    assert parse_count("4096") == 4096
    assert parse_count(7) == 7
    assert parse_count("9007199254740991") == 2**53 - 1  # exact, not through a float
    assert parse_count("8796093022208Ki") == 2**53
    assert parse_count("9007199254740991.0") == 2**53 - 1
    # past 2^53 a token count is no real one (`kvdiet plan` printed float noise for it); byte sizes are not capped
    with pytest.raises(
        ValueError, match=r"^token count 9,007,199,254,740,993 is past 2\^53 \(9,007,199,254,740,992\)"
    ):
        parse_count("9007199254740993")
    with pytest.raises(ValueError, match=r"^token count some 10\^34 is past 2\^53"):
        parse_count("99999999999999999999999999999M")
    assert parse_bytes("99999999999999999999") == 99_999_999_999_999_999_999
    assert parse_count("4.1G") == 4_100_000_000 and parse_bytes("4.1GB") == 4_100_000_000  # no float error
    with pytest.raises(ValueError, match="not a whole number"):
        parse_count("1.000000000000000000001K")
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("1.5KB") == 1500
    assert format_bytes(2_703_360) == "2.70 MB"


@pytest.mark.parametrize("bad", ["", "abc", "-5", "1.5", "4XB", "1e3"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_count(bad)


def test_a_negative_count_or_size_is_named_as_negative() -> None:
    """``--context -5`` said it could not parse '-5'; it is a count, below 0."""
    with pytest.raises(ValueError, match=r"^token count must be >= 0, got '-5'$"):
        parse_count("-5")
    with pytest.raises(ValueError, match=r"^byte size must be >= 0, got '-2GiB'$"):
        parse_bytes("-2GiB")
    with pytest.raises(ValueError, match="cannot parse token count '--5'"):
        parse_count("--5")


def test_format_tokens_counts_one_token_as_one() -> None:
    assert [format_tokens(n) for n in (0, 1, 2, 131072)] == [
        "0 tokens",
        "1 token",
        "2 tokens",
        "131,072 tokens",
    ]


def test_a_count_past_a_floats_range_is_still_short() -> None:
    """A client's 4,000-digit ``max_tokens`` (JSON allows it) came back whole in the context-length error: some
    5,000 characters of message; `format_count` itself raised OverflowError past 1e308."""
    from kvdiet.engine.prepared import ContextLengthError

    assert format_count(10**400) == "1.000e+400"
    assert format_count(-(10**400)) == "-1.000e+400"
    assert format_tokens(10**30) == "1.000e+30 tokens"
    said = str(ContextLengthError(12, int("9" * 4000), 1_048_576, "max_model_len"))
    assert said == (
        "prompt (12 tokens) + max_tokens (1.000e+4000) = 1.000e+4000 tokens > max_model_len 1,048,576; shorten "
        "the prompt or lower max_tokens"
    )


def test_durations_are_case_insensitive_but_a_capital_m_is_refused() -> None:
    """Units in any case, as byte sizes take them (``8gb``); a bare ``M`` could be months as well as minutes, so
    it is refused with a message naming the minute units rather than taken as 60 s."""
    from kvdiet.units import parse_bytes, parse_duration

    assert parse_bytes("8gb") == parse_bytes("8GB") == 8 * 10**9
    same = {
        259_200.0: ("72h", "72H", "3d", "3D", "4320m", "4320min", "4320MIN", "4320Min"),
        0.25: ("250ms", "250MS", "250Ms", "250mS", "0.25s", "0.25S"),
        300.0: ("5m", "5 min", "300S", "300"),
    }
    for seconds, texts in same.items():
        assert [parse_duration(t) for t in texts] == [seconds] * len(texts), texts
    for text in ("1M", "5 M", " 72M "):
        with pytest.raises(ValueError, match=r"'M' is ambiguous \(minutes or months\?\); write 'm' or 'min'"):
            parse_duration(text)
    for text in ("5mo", "5MO", "1y", "1W", "INF", "inf", "5x"):
        with pytest.raises(ValueError, match="cannot parse duration"):
            parse_duration(text)


def test_format_duration_uses_human_units() -> None:
    from kvdiet.units import format_duration

    assert [format_duration(s) for s in (259200, 300, 90, 30, 0.25, 0)] == [
        "72 h",
        "5 min",
        "1.5 min",
        "30 s",
        "250 ms",
        "0 s",
    ]


def test_flag_types_take_positive_counts_and_refuse_the_rest_as_argparse_errors():
    """The benchmark scripts' flag types: counts with suffixes, lists of them, whole numbers ≥ 1; anything else an
    ArgumentTypeError (argparse prints it as one line and exits 2)."""
    assert units.positive_count("4K") == 4000 and units.positive_count("1Mi") == 1 << 20
    assert units.count_list("256,1Ki") == [256, 1024]
    assert units.positive_int("3") == 3
    for bad in ("0", "-5", "abc", "", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            units.positive_count(bad)
    for bad in ("4K,,8K", "1,0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            units.count_list(bad)
    for bad in ("0", "-1", "2.0", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            units.positive_int(bad)


def test_comma_items_strip_and_refuse_an_empty_item() -> None:
    from kvdiet.units import comma_items

    assert comma_items("--x", " 4K, 8K ", "counts") == ["4K", "8K"]
    with pytest.raises(ValueError, match=r"^--x: item 3 is empty \(ids are comma-separated\)$"):
        comma_items("--x", "1,2, ,4", "ids")


def test_unbounded_is_taken_only_where_it_is_the_default() -> None:
    """``--persistent-size unbounded`` (its --help's "default unbounded") was "cannot parse byte size"; a size or
    TTL that needs a bound now names that, not a parse failure."""
    assert [
        units.parse_bytes_or_unbounded(t) for t in ("unbounded", " UNBOUNDED ", "Unbounded", None, "2MB")
    ] == [
        None,
        None,
        None,
        None,
        2 * 10**6,
    ]
    assert (
        units.is_unbounded("UnBounded") and not units.is_unbounded("unbound") and not units.is_unbounded(None)
    )
    with pytest.raises(ValueError) as info:
        units.parse_duration("Unbounded")
    assert str(info.value) == (
        "duration 'Unbounded': this one needs a bound (examples: 72h, 5m, 30s, 250ms, 90); 'unbounded' is taken "
        "only where it is the default"
    )
    with pytest.raises(ValueError, match=r"^byte size 'unbounded': this one needs a bound \(examples: 4GiB"):
        parse_bytes("unbounded")
    with pytest.raises(
        ValueError, match=r"^token count 'unbounded': this one needs a bound \(examples: 4096"
    ):
        parse_count("unbounded")


def test_format_gb_keeps_huge_values_short() -> None:
    from kvdiet.units import format_gb

    assert format_gb(1234.5) == "1,234.50"
    assert format_gb(298.049, 1) == "298.0"
    assert format_gb(999_999_999_999.0, 0) == "999,999,999,999"
    assert format_gb(1e30) == "1.000e+30"  # fixed point printed 40 digits
    assert format_gb(-2e15) == "-2.000e+15"


def test_format_count_keeps_huge_counts_short() -> None:
    from kvdiet.units import format_count

    assert format_count(131_072) == "131,072"
    assert format_count(999_999_999_999_999) == "999,999,999,999,999"
    assert format_count(68_582_439_384_096_780_988_899_371_414_137) == "6.858e+31"  # plan --gpu-mem-gb 1e30
    assert format_count(-(10**15)) == "-1.000e+15"
