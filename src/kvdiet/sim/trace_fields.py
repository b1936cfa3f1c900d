"""The fields of one trace line, read and checked (`kvdiet.sim.traces`' readers; `number`, `count` and
`check_tokens` also `kvdiet.sim.agentic`'s, which names a field by its path): its JSON value (bytes that are not
UTF-8 named as such), times, token counts (at most `MAX_REQUEST_TOKENS`: past it the simulator would try to hold the
request's blocks in memory; a mistyped ``1e12`` died of a MemoryError) and optional labels. Each raises ValueError
naming the field; the readers add the line."""

from __future__ import annotations

import json
import math
import sys

from kvdiet.sim.trace_file import shorten

__all__ = [
    "LABELS",
    "MAX_REQUEST_TOKENS",
    "check_tokens",
    "count",
    "json_line",
    "label",
    "long_number",
    "number",
]

MAX_REQUEST_TOKENS = 1 << 30
"""The longest prompt or output a trace line may give (tokens), a thousand times V4.1's context: past it a line is
malformed (its blocks would not fit in memory)."""


def json_line(text: str) -> object:
    """One line's JSON value, else ValueError in the line's own terms (bytes read as U+FFFD: not UTF-8)."""
    try:
        return json.loads(text.rstrip("\r\n"))
    except RecursionError:  # arrays or objects nested past Python's recursion limit
        raise ValueError("JSON nested too deep") from None
    except json.JSONDecodeError as exc:
        if "\ufffd" in text:
            raise ValueError("bytes that are not UTF-8") from None
        raise ValueError(f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
    except ValueError:  # an integer literal past Python's limit on its digits
        raise ValueError(long_number()) from None


def long_number() -> str:
    """What a JSON reader says of an integer literal with more digits than Python converts (``json.loads`` raises a
    bare ValueError that names ``sys.set_int_max_str_digits``)."""
    return f"not valid JSON (an integer of more than {sys.get_int_max_str_digits():,} digits)"


LABELS = ("session", "agent", "kind")
"""Optional string columns of a generic line: which session and agent sent it, and its traffic kind."""


def label(obj: dict, key: str) -> str | None:
    """An optional label column: a non-empty string, or None when absent."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or not value.isprintable():
        raise ValueError(f"{key} must be a non-blank string of printable characters, got {shorten(value)}")
    return value


def number(obj: dict, key: str, name: str | None = None) -> float:
    """A time field (seconds): a finite number >= 0, else ValueError naming it ``name`` (default ``key``). An integer
    past a float's range is not finite either (``float()`` of it would raise OverflowError)."""
    value = obj.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= sys.float_info.max:
        raise ValueError(f"{name or key} must be a finite number >= 0, got {shorten(value)}")
    return float(value)


def count(obj: dict, key: str, name: str | None = None) -> int:
    """A token count field: an integer >= 0 (an integral float taken as one), at most `MAX_REQUEST_TOKENS`, else
    ValueError naming it ``name`` (default ``key``)."""
    value, name = obj.get(key), name or key
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{name} must be a whole number of tokens, got {shorten(value)}")
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {shorten(value)}")
    return check_tokens(value, name)


def check_tokens(value: int, key: str) -> int:
    """``value`` (tokens, read as ``key``) where at most `MAX_REQUEST_TOKENS`, else ValueError (the count shortened:
    a float like 1e300 reads as a 301-digit integer)."""
    if value > MAX_REQUEST_TOKENS:
        shown = f"{value:,}" if value < 10**15 else f"some 10^{len(str(value)) - 1}"
        raise ValueError(f"{key} of {shown} tokens is past {MAX_REQUEST_TOKENS:,}: not a real request")
    return value
