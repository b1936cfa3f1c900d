"""Token-count and byte-size parsing."""

from __future__ import annotations

import pytest

from kvdiet.units import format_bytes, parse_bytes, parse_count


def test_parse() -> None:
    assert parse_count("128K") == 128_000
    assert parse_count("1Mi") == 1_048_576
    assert parse_count("4096") == 4096
    assert parse_count(7) == 7
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("1.5KB") == 1500
    assert format_bytes(2_703_360) == "2.70 MB"


@pytest.mark.parametrize("bad", ["", "abc", "-5", "1.5", "4XB", "1e3"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_count(bad)


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
