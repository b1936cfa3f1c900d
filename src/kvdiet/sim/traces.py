"""Request traces: Mooncake JSONL, kvdiet's generic JSONL, and the Azure 2023 CSV, read into one form.

Formats (``format="auto"`` picks by the file: ``.csv`` → Azure; a first line with ``"format": "kvdiet-trace"``
→ generic; other JSONL → Mooncake):

- **Mooncake** (FAST'25 release, ``FAST25-release/traces/*.jsonl``): one object per line, ``timestamp`` (ms
  since the trace start), ``input_length`` and ``output_length`` (tokens), ``hash_ids`` (prefix-block ids of
  512 tokens, chained: the same id at the same position is the same prefix; the last block may be
  partial, so ``len(hash_ids) == ceil(input_length / 512)``).
- **generic JSONL**: a header line ``{"format": "kvdiet-trace", "version": 1, "block_size": B}``, then
  objects with ``arrival_s`` (seconds), ``input_length``, ``output_length`` and ``hash_ids`` (blocks of B
  tokens, same rule) — for traces with another block size (e.g. Alibaba Bailian's 16) — and optionally
  ``session``, ``agent`` and ``kind`` (strings: e.g. ``"agent"``, ``"subagent"``, ``"chat"`` for mixed
  traffic), which the study splits its figures by.
- **Azure** LLM inference 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps with 100-ns digits):
  no prefix information, so every prompt is unique (``hash_ids`` is None).

Both id conventions are read: one id per block, the partial last block included (``ceil``, Mooncake's), or one id per
*full* block (``input_length // B``; the partial last block has none), decided per trace by its first request with a
partial block; the reader gives each unnamed partial block a fresh id (never seen elsewhere in the trace, so it never
hits), so every `TraceRequest` holds ``ceil`` ids. Lengths may be integral floats (``99266.0``), at most
`kvdiet.sim.trace_fields.MAX_REQUEST_TOKENS`; times must be finite, and are counted from the trace's first request
(epoch timestamps too).

A malformed line is reported with its line number: ``strict=True`` raises `TraceError` at the first one; otherwise it is
skipped, counted in `Trace.errors`, and reading goes on — unless most lines are skipped, which raises `TraceError` with
a summary. Timestamps going backwards are re-sorted and counted (`Trace.out_of_order`); ``strict=True`` refuses them.
This module knows nothing of models or caches.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvdiet.sim.chains import chain_ids
from kvdiet.sim.trace_fields import LABELS, MAX_REQUEST_TOKENS, check_tokens, count, json_line, label, number
from kvdiet.sim.trace_file import bounded_lines, gzip_errors, open_text, shorten

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "Trace",
    "TraceError",
    "TraceRequest",
    "read_trace",
]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces (their README)."""

FORMATS = ("auto", "mooncake", "jsonl", "azure")


class TraceError(ValueError):
    """A trace line that cannot be read (the message starts with ``file:line``)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: seconds since the trace's first request.
        input_tokens / output_tokens: prompt and output lengths (tokens).
        hash_ids: prefix-block ids (``ceil(input_tokens / block_size)`` of them; a partial last block the
            trace left unnamed has a fresh id), or None (unique prompt); chained and >= 0 as the readers
            return them (`kvdiet.sim.chains`).
        line: the line it came from (1-based; in a session file, the request's place in it).
        session / agent / kind: for traffic that carries them (agentic session files, `kvdiet.sim.agentic`;
            generic lines with those columns), the session's id, the agent that sent the request (``"main"``
            or a sub-agent's id) and the traffic kind (``"agent"``, ``"subagent"``, ``"chat"``, …); None
            otherwise.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None
    line: int
    session: str | None = None
    agent: str | None = None
    kind: str | None = None


@dataclass(slots=True)
class Trace:
    """A read trace: requests in arrival order, the block size of their ``hash_ids``, and skipped lines.

    Attributes:
        full_blocks_only: True when the file named full blocks only (the reader named each partial last
            block), False when it named partial blocks too, None when no request had a partial block.
        out_of_order: requests that arrive before one read earlier (a line above, or an earlier entry of their
            session's list; re-sorted).
    """

    requests: list[TraceRequest]
    block_size: int
    errors: list[str] = field(default_factory=list)
    full_blocks_only: bool | None = None
    out_of_order: int = 0

    def __len__(self) -> int:
        return len(self.requests)


def read_trace(path: str | Path, *, format: str = "auto", strict: bool = False) -> Trace:
    """Read a trace file (see the module docstring).

    Raises:
        TraceError: an unknown format; a first record of another shape than the format's (a generic line
            without its header, an agentic session file); a generic file without its header; ``strict`` and
            a malformed line or a timestamp going backwards; more lines malformed than read (a summary of
            the first reasons with their line numbers); a gzip file cut short or corrupt (named); a folder.
        OSError: the file cannot be read.

    A gzip file is read decompressed and a UTF-8 byte-order mark dropped (`kvdiet.sim.trace_file`).
    """
    path = Path(path)
    if format not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; choose one of {', '.join(FORMATS)}")
    if path.is_dir():  # was the bare OSError "[Errno 21] Is a directory"
        kind = "trace file" if format == "auto" else f"{format} trace file"
        raise TraceError(
            f"{path}: a folder, not a {kind} (a folder of agentic session files is read with --format "
            "agentic-sessions, or auto)"
        )
    with gzip_errors(path, TraceError):
        format = _detect(path) if format == "auto" else format
        if format == "azure":
            block_size, items = MOONCAKE_BLOCK_SIZE, _azure(path)
        else:
            generic = format == "jsonl"
            block_size = _header_block_size(path) if generic else MOONCAKE_BLOCK_SIZE
            items = _jsonl(path, _lines(path, skip_header=generic), block_size, generic=generic)
        ids = _IdConvention(path, block_size)
        requests, errors, late = _collect(path, map(ids.check, items), strict)
    if requests and requests[0].arrival_s != 0:  # epoch times; an Azure file whose first row is not earliest
        requests = [replace(r, arrival_s=r.arrival_s - requests[0].arrival_s) for r in requests]
    requests = chain_ids(_name_partial_blocks(requests, block_size))
    return Trace(requests, block_size, errors, ids.full_only, late)


# --- readers ---


def _detect(path: Path) -> str:
    """The format of ``path`` from its suffix and the shape of its first record.

    Raises:
        TraceError: a first record that is a generic trace line without its header, an agentic session
            file, or an object with none of the fields of a known trace.
    """
    if path.name.lower().removesuffix(".gz").endswith(".csv"):
        return "azure"
    with open_text(path) as f:
        first = next((text for _, text in bounded_lines(f, path, TraceError) if text.strip()), "")
    try:
        head = json.loads(first)
    except (ValueError, RecursionError):  # not JSON, or an integer past Python's digit limit
        return "mooncake"  # each line is then reported as it is read
    if not isinstance(head, dict):
        return "mooncake"
    if head.get("format") == "kvdiet-trace":
        return "jsonl"
    if "timestamp" in head:
        return "mooncake"
    if "arrival_s" in head:
        raise TraceError(
            f"{path}:1: a generic kvdiet trace line (arrival_s) but no header: the file must start with "
            '{"format": "kvdiet-trace", "version": 1, "block_size": B}'
        )
    if "requests" in head:
        raise TraceError(
            f"{path}:1: an agentic session file (top-level requests): use --format agentic-sessions"
        )
    raise TraceError(
        f"{path}:1: not a known trace: expected a Mooncake line (timestamp, input_length, output_length, "
        f"hash_ids) or a kvdiet-trace header; the first record has {', '.join(sorted(head)) or 'no fields'}"
    )


def _header_block_size(path: Path) -> int:
    """The ``block_size`` of a generic trace's header line.

    Raises:
        TraceError: no header line, another version than 1, or a block size that is not an integer >= 1.
    """
    expected = '{"format": "kvdiet-trace", "version": 1, "block_size": B}'
    with open_text(path) as f:
        first = next((text for _, text in bounded_lines(f, path, TraceError) if text.strip()), "")
    try:
        head = json.loads(first)
    except (ValueError, RecursionError):  # not JSON, or an integer past Python's digit limit
        head = None
    if not isinstance(head, dict) or head.get("format") != "kvdiet-trace":
        raise TraceError(f"{path}:1: a generic trace starts with {expected}")
    if head.get("version") != 1:
        raise TraceError(
            f"{path}:1: generic trace version {shorten(head.get('version'))}; this reader reads version 1"
        )
    block_size = head.get("block_size")
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or not 1 <= block_size <= MAX_REQUEST_TOKENS
    ):
        raise TraceError(
            f"{path}:1: block_size must be an integer in [1, {MAX_REQUEST_TOKENS:,}] (tokens per hash id), "
            f"got {shorten(block_size)}"
        )
    return block_size


def _lines(path: Path, *, skip_header: bool) -> Iterator[tuple[int, str]]:
    with open_text(path) as f:
        lines = ((n, text) for n, text in bounded_lines(f, path, TraceError) if text.strip())
        if skip_header:
            next(lines, None)
        yield from lines


def _jsonl(path: Path, lines: Iterator[tuple[int, str]], block_size: int, *, generic: bool):
    time_key, scale = ("arrival_s", 1.0) if generic else ("timestamp", 1e-3)
    fields = (time_key, "input_length", "output_length", "hash_ids")
    for n, text in lines:
        try:
            obj = json_line(text)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if missing := [k for k in fields if k not in obj]:
                raise ValueError(
                    f"no {', '.join(missing)} (a {'generic' if generic else 'Mooncake'} line has "
                    f"{', '.join(fields)}; this one has {', '.join(sorted(obj)) or 'no fields'})"
                )
            t = number(obj, time_key) * scale
            inp, out = count(obj, "input_length"), count(obj, "output_length")
            ids = obj["hash_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise ValueError("hash_ids must be a list of integers")
            full, blocks = inp // block_size, -(-inp // block_size)
            if len(ids) not in (full, blocks):
                other = (
                    "" if full == blocks else f", or {inp} // {block_size} = {full} (one id per full block)"
                )
                raise ValueError(
                    f"{len(ids)} hash_ids for input_length {inp}: expected ceil({inp} / {block_size}) = "
                    f"{blocks}{other}"
                )
            labels = {k: label(obj, k) for k in LABELS} if generic else {}
            yield TraceRequest(t, inp, out, tuple(ids), n, **labels)
        except (ValueError, TypeError) as exc:
            yield TraceError(f"{path}:{n}: {exc}")


def _azure(path: Path):
    try:
        yield from _azure_rows(path)
    except csv.Error as exc:  # e.g. a quote never closed: a field past csv's limit
        raise TraceError(f"{path}: not a CSV trace ({exc})") from None


def _azure_rows(path: Path):
    with open_text(path, newline="") as f:
        rows = csv.reader(text for _, text in bounded_lines(f, path, TraceError))
        header = next(rows, None)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            got = shorten(",".join(header or []))  # a JSONL line read as CSV can be megabytes
            yield TraceError(
                f"{path}:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens, got {got}"
            )
            return
        start = None
        for n, row in enumerate(rows, 2):
            if len(row) <= 1 and not "".join(row).strip():  # a blank line, as the JSONL readers skip them
                continue
            try:
                if len(row) != 3:
                    raise ValueError(f"expected 3 fields, got {len(row)}")
                stamp = _azure_time(row[0])
                start = stamp if start is None else start
                # a time zone on one and none on the other: no difference between them is defined
                if (stamp.utcoffset() is None) != (start.utcoffset() is None):
                    has = ("has no", "has one") if stamp.utcoffset() is None else ("has a", "has none")
                    raise ValueError(
                        f"TIMESTAMP {row[0].strip()!r} {has[0]} time zone where the first row's {has[1]} "
                        "(give every row one, or none)"
                    )
                inp, out = int(row[1]), int(row[2])
                if inp < 0 or out < 0:
                    raise ValueError("token counts must be >= 0")
                check_tokens(inp, "ContextTokens")
                check_tokens(out, "GeneratedTokens")
                yield TraceRequest((stamp - start).total_seconds(), inp, out, None, n)
            except ValueError as exc:
                yield TraceError(f"{path}:{n}: {exc}")


_AZURE_TIME = re.compile(r"(?P<head>[^.]*)(?:\.(?P<frac>\d+))?(?P<zone>Z|[+-]\d\d(?::?\d\d)?)?")


def _azure_time(text: str) -> dt.datetime:
    """``2023-11-16 18:15:46.6805900``: seven fractional digits (100 ns); Python takes six. A time zone after
    them (``…46.6805900+00:00``, ``…Z``) is kept. Raises ValueError for text that is no ISO time."""
    match = _AZURE_TIME.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"Invalid isoformat string: {text.strip()!r}")
    head, frac, zone = match["head"], match["frac"], match["zone"] or ""
    return dt.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}{zone}" if frac else f"{head}{zone}")


class _IdConvention:
    """Decides from a trace's first request with a partial last block whether the trace names that block
    (``ceil`` ids) or full blocks only (``//``); a later request that follows the other rule is malformed."""

    def __init__(self, path: Path, block_size: int) -> None:
        self.path, self.block_size = path, block_size
        self.full_only: bool | None = None
        self.line = 0

    def check(self, item: TraceRequest | TraceError) -> TraceRequest | TraceError:
        bs = self.block_size
        if isinstance(item, TraceError) or item.hash_ids is None or item.input_tokens % bs == 0:
            return item
        n, k = item.input_tokens, len(item.hash_ids)
        full_only = k == n // bs
        if self.full_only is None:
            self.full_only, self.line = full_only, item.line
        elif full_only != self.full_only:
            rule = (
                f"{n} // {bs} = {n // bs} (one id per full block"
                if self.full_only
                else f"ceil({n} / {bs}) = {-(-n // bs)} (one id per block, the partial last one included"
            )
            return TraceError(
                f"{self.path}:{item.line}: {k} hash_ids for input_length {n}: expected {rule}, as line {self.line})"
            )
        return item


def _name_partial_blocks(requests: list[TraceRequest], block_size: int) -> list[TraceRequest]:
    """Give each partial last block without an id a fresh one (above every id of the trace: never a hit)."""
    top = max((h for r in requests if r.hash_ids for h in r.hash_ids), default=-1)
    fresh = itertools.count(top + 1)
    return [
        replace(r, hash_ids=(*r.hash_ids, next(fresh)))
        if r.hash_ids is not None and len(r.hash_ids) < -(-r.input_tokens // block_size)
        else r
        for r in requests
    ]


def _collect(path: Path, items, strict: bool) -> tuple[list[TraceRequest], list[str], int]:
    """Requests sorted by arrival, skipped lines, and how many requests arrived before an earlier line's.

    Raises:
        TraceError: ``strict`` and a malformed line or a timestamp going backwards; more lines malformed
            than read.
    """
    requests: list[TraceRequest] = []
    errors: list[str] = []
    late, latest = 0, None
    for item in items:
        if isinstance(item, TraceError):
            if strict:
                raise item
            errors.append(str(item))
            continue
        if latest is not None and item.arrival_s < latest.arrival_s:
            if strict:
                raise TraceError(
                    f"{path}:{item.line}: arrives at {item.arrival_s:g} s, before line {latest.line} "
                    f"({latest.arrival_s:g} s): timestamps go backwards"
                )
            late += 1
        else:
            latest = item
        requests.append(item)
    if len(errors) > len(requests):
        first = "; ".join("line " + e.removeprefix(f"{path}:") for e in errors[:3])
        raise TraceError(
            f"{path}: {len(errors):,} of {len(errors) + len(requests):,} lines malformed, so the trace is "
            f"refused; the first {min(3, len(errors))}: {first}"
        )
    requests.sort(key=lambda r: (r.arrival_s, r.line))
    return requests, errors, late
