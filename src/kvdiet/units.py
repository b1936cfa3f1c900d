"""Parsing and printing of token counts and byte sizes, and a flag's parse errors named by the flag.

SI suffixes are decimal (``128K`` = 128,000 tokens, ``1GB`` = 10⁹ bytes); ``Ki``/``Mi``/``Gi`` suffixes
are binary (``4GiB`` = 4·2³⁰ bytes, ``1Mi`` = 1,048,576 tokens). kvdiet prints bytes in decimal units
(GB = 10⁹ B), as GPU memory is quoted (H200 141 GB). Suffixes and duration units take any case, except a
duration's bare ``M`` (minutes or months?), which is refused. ``unbounded`` (any case) is a value only where it
is the default (`parse_bytes_or_unbounded`); a size or duration that needs a bound refuses it by name.
"""

from __future__ import annotations

import argparse
import math
import re
import string
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import TypeVar

__all__ = [
    "comma_items",
    "count_list",
    "format_bytes",
    "format_count",
    "format_duration",
    "format_tokens",
    "is_unbounded",
    "parse_bytes",
    "parse_bytes_or_unbounded",
    "parse_count",
    "parse_duration",
    "parse_flag",
    "positive_count",
    "positive_int",
]

_MULT = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?)?\s*$", re.IGNORECASE)


def parse_count(text: str | int) -> int:
    """Parse a token count such as ``4096``, ``128K`` (128,000) or ``1Mi`` (1,048,576).

    Raises:
        ValueError: not a non-negative whole number with an optional suffix.
    """
    return _parse(text, what="token count", strip_b=False)


def positive_count(text: str) -> int:
    """A flag's token count of at least 1 (``4K``, ``1Mi``, ``256``), for argparse's ``type=``.

    Raises:
        argparse.ArgumentTypeError: not a count (`parse_count`), or 0.
    """
    try:
        count = parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"a count must be at least 1, got {text!r}")
    return count


def comma_items(flag: str, text: str, what: str) -> list[str]:
    """A flag's comma-separated items, stripped (``what``: what they are, for the error).

    Raises:
        ValueError: an empty item, named by its number from 1 and by the flag (``--contexts: item 2 is empty
            (counts are comma-separated)``).
    """
    items = [item.strip() for item in text.split(",")]
    if empty := [i for i, item in enumerate(items, 1) if not item]:
        raise ValueError(f"{flag}: item {empty[0]} is empty ({what} are comma-separated)")
    return items


def count_list(text: str) -> list[int]:
    """A flag's comma-separated `positive_count` values (``4K,1Mi`` → [4000, 1048576]), for argparse's ``type=``.

    Raises:
        argparse.ArgumentTypeError: an empty item, or one that is not a count of at least 1.
    """
    return [positive_count(item) for item in text.split(",")]


def positive_int(text: str) -> int:
    """A flag's whole number of at least 1 (steps, repeats, threads), for argparse's ``type=``.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_bytes(text: str | int) -> int:
    """Parse a byte size such as ``4GiB``, ``141GB``, ``512MB`` or ``1000``.

    Raises:
        ValueError: not a non-negative whole number of bytes with an optional suffix; ``unbounded`` is named
            as needing a bound (`parse_bytes_or_unbounded` takes it).
    """
    return _parse(text, what="byte size", strip_b=True)


def is_unbounded(text: object) -> bool:
    """Whether a flag's value is the word ``unbounded`` (any case, spaces around it ignored)."""
    return isinstance(text, str) and text.strip().lower() == "unbounded"


def parse_bytes_or_unbounded(text: str | int | None) -> int | None:
    """A byte size whose default is no bound (``--persistent-size``): None for no value (None, ``""``) or
    ``unbounded`` (any case: exactly the default), else `parse_bytes`.

    Raises:
        ValueError: as `parse_bytes`.
    """
    return None if text is None or text == "" or is_unbounded(text) else parse_bytes(text)


def _bounded(raw: str, what: str, examples: str) -> None:
    """Refuse ``unbounded`` for a size or duration that needs a bound, saying so (not "cannot parse")."""
    if is_unbounded(raw):
        raise ValueError(
            f"{what} {raw.strip()!r}: this one needs a bound (examples: {examples}); 'unbounded' is taken only "
            "where it is the default"
        )


_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float) -> float:
    """Parse a duration such as ``72h``, ``5m``, ``30s``, ``250ms``, ``1.5d`` or ``90`` (seconds) → seconds.

    Units are case-insensitive (``72H``, ``5MIN``, ``250MS``, ``1D``), as byte sizes are, with one exception: a
    bare capital ``M`` is refused, since it reads as months (ISO 8601's ``P1M``) as easily as minutes, and a
    month's TTL taken as a minute would be wrong silently; ``m`` and ``min`` (any case) are minutes. kvdiet has
    no month unit.

    Raises:
        ValueError: not a positive finite number with an optional unit (ms, s, m/min, h, d), the ambiguous
            ``M``, or ``unbounded`` (a TTL that needs a bound; named as such).
    """
    raw = str(text).strip()
    _bounded(raw, "duration", "72h, 5m, 30s, 250ms, 90")
    num = raw.rstrip(string.ascii_letters)
    unit = raw[len(num) :] or "s"
    if unit == "M":
        raise ValueError(
            f"duration {raw!r}: 'M' is ambiguous (minutes or months?); write 'm' or 'min' for minutes"
        )
    try:
        value = float(num) * _SECONDS[unit.lower()]
    except (KeyError, ValueError):
        raise ValueError(f"cannot parse duration {raw!r} (examples: 72h, 5m, 30s, 250ms, 90)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"duration must be > 0 and finite, got {raw!r}")
    return value


_MAX_TOKENS = 1 << 53
"""The largest token count `_parse` takes (some 9·10^15): past it a float (the planner's and the simulator's
arithmetic) no longer holds every whole number, and `kvdiet plan` printed rounding noise as digits. Byte sizes are
not capped (a pool "as large as anything" may be written 1000000TB)."""


def _parse(text: str | int, *, what: str, strip_b: bool) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        raw = str(text)
        _bounded(raw, what, "4GiB, 141GB, 512MB, 1000" if strip_b else "4096, 128K, 1Mi")
        body = raw[:-1] if strip_b and raw.strip().upper().endswith("B") else raw
        match = _PATTERN.match(body)
        if not match:
            if body.strip().startswith("-") and _PATTERN.match(body.strip()[1:]):  # a negative one: say so
                raise ValueError(f"{what} must be >= 0, got {raw.strip()!r}")
            examples = "4GiB, 141GB, 512MB, 1000" if strip_b else "4096, 128K, 1Mi"
            raise ValueError(f"cannot parse {what} {raw!r} (examples: {examples})")
        number, suffix = match.groups()
        exact = Fraction(number) * _MULT[(suffix or "").upper()]  # the decimal exactly (4.1G: no float error)
        if exact.denominator != 1:
            raise ValueError(f"{what} {raw!r} is not a whole number")
        value = int(exact)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    if not strip_b and value > _MAX_TOKENS:
        shown = f"{value:,}" if value < 10**18 else f"some 10^{len(str(value)) - 1}"
        raise ValueError(f"{what} {shown} is past 2^53 ({_MAX_TOKENS:,}): not a real one")
    return value


def format_bytes(num: float) -> str:
    """``2703360`` → ``'2.70 MB'`` (decimal units)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num:g} B"


def format_gb(gb: float, decimals: int = 2) -> str:
    """A number of GB with thousands separators and ``decimals`` places, ``1234.5`` → ``'1,234.50'``; past
    1e12 (a zettabyte) in scientific notation, ``1e30`` → ``'1.000e+30'`` (fixed point printed 40 digits)."""
    return f"{gb:,.{decimals}f}" if abs(gb) < 1e12 else f"{gb:.3e}"


def format_duration(seconds: float) -> str:
    """Seconds in the largest unit of ms, s, min, h that keeps the number >= 1: ``259200`` → ``'72 h'``,
    ``300`` → ``'5 min'``, ``90`` → ``'1.5 min'``, ``30`` → ``'30 s'``, ``0.25`` → ``'250 ms'`` (at most
    two decimals; the inverse of `parse_duration` up to rounding). A non-finite value prints as ``'inf s'``.
    """
    if not math.isfinite(seconds):
        return f"{seconds} s"
    for unit, scale in (("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if abs(seconds) >= scale:
            return f"{_short(seconds / scale)} {unit}"
    return f"{_short(seconds * 1e3)} ms" if seconds else "0 s"


def _short(value: float) -> str:
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def format_count(num: int) -> str:
    """``131072`` → ``'131,072'``; from 1e15 on in scientific notation, as `format_gb` past 1e12:
    ``68582439384096780988899371414137`` → ``'6.858e+31'`` (a count that long reads as nothing but its length), and
    so past a float's range (``'1.000e+4000'``: a client's 4,000-digit ``max_tokens``, which JSON allows, came back
    whole in an error, some 5,000 characters)."""
    return f"{num:,}" if abs(num) < 10**15 else f"{Decimal(num):.3e}"  # exact, past a float's range too


def format_tokens(num: int) -> str:
    """``1`` → ``'1 token'``, ``131072`` → ``'131,072 tokens'`` (`format_count`: from 1e15 on scientific)."""
    return f"{format_count(num)} token{'' if num == 1 else 's'}"


_T = TypeVar("_T")


def parse_flag(name: str, parse: Callable[[str], _T], value: str) -> _T:
    """``parse(value)``; a ValueError is raised again with the flag's name in front (``--context: cannot parse
    token count 'abc' …``)."""
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
