"""Request traces: Mooncake JSONL, kvdiet's generic JSONL, and the Azure 2023 CSV, read into one form.

Formats (``format="auto"`` picks by the file: ``.csv`` → Azure; a first line with ``"format": "kvdiet-trace"``
→ generic; other JSONL → Mooncake):

- **Mooncake** (FAST'25 release, ``FAST25-release/traces/*.jsonl``): one object per line, ``timestamp`` (ms
  since the trace start), ``input_length`` and ``output_length`` (tokens), ``hash_ids`` (prefix-block ids of
  512 tokens, chained: the same id at the same position is the same prefix; the last block may be
  partial, so ``len(hash_ids) == ceil(input_length / 512)``).
- **generic JSONL**: a header line ``{"format": "kvdiet-trace", "version": 1, "block_size": B}``, then
  objects with ``arrival_s`` (seconds), ``input_length``, ``output_length`` and ``hash_ids`` (blocks of B
  tokens, same rule) — for traces with another block size (e.g. Alibaba Bailian's 16).
- **Azure** LLM inference 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps with 100-ns digits):
  no prefix information, so every prompt is unique (``hash_ids`` is None).

A malformed line is reported with its line number: ``strict=True`` raises `TraceError` at the first one;
otherwise it is skipped, counted in `Trace.errors`, and reading goes on. This module knows nothing of
models or caches.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "Trace",
    "TraceError",
    "TraceRequest",
    "hit_ratio_variants",
    "infinite_cache_hit_ratio",
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
        hash_ids: prefix-block ids (``ceil(input_tokens / block_size)`` of them), or None (unique prompt).
        line: the line it came from (1-based; in a session file, the request's place in it).
        session / agent / kind: for traffic that carries them (`kvdiet.sim.agentic`), the session's id, the
            agent that sent the request (``"main"`` or a sub-agent's id) and the traffic kind (``"agent"``,
            ``"subagent"``, ``"chat"``); None otherwise.
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
    """A read trace: requests in arrival order, the block size of their ``hash_ids``, and skipped lines."""

    requests: list[TraceRequest]
    block_size: int
    errors: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


def read_trace(path: str | Path, *, format: str = "auto", strict: bool = False) -> Trace:
    """Read a trace file (see the module docstring).

    Raises:
        TraceError: ``strict`` and a malformed line; an unknown format; a generic file without its header.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if format not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "auto":
        format = _detect(path)
    if format == "azure":
        requests, errors = _collect(_azure(path), strict)
        return Trace(requests, MOONCAKE_BLOCK_SIZE, errors)
    generic = format == "jsonl"
    block_size = _header_block_size(path) if generic else MOONCAKE_BLOCK_SIZE
    lines = _lines(path, skip_header=generic)
    requests, errors = _collect(_jsonl(path, lines, block_size, generic=generic), strict)
    return Trace(requests, block_size, errors)


def infinite_cache_hit_ratio(trace: Trace) -> float:
    """Share of all ``hash_ids`` blocks found by contiguous-prefix matching in a cache that never forgets:
    each request hits its leading blocks up to the first one no earlier request had (chained ids make
    "seen before" mean "same prefix"). Requests without ``hash_ids`` count their blocks as misses."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace.requests:
        if r.hash_ids is None:
            total += -(-r.input_tokens // trace.block_size)
            continue
        total += len(r.hash_ids)
        matching = True
        for h in r.hash_ids:
            if matching and h in seen:
                hits += 1
            else:
                matching = False
            seen.add(h)
    return hits / total if total else 0.0


def hit_ratio_variants(trace: Trace) -> dict[str, float]:
    """The infinite-cache hit ratio counted four ways (papers rarely say which they report):

    - ``blocks``: hit blocks / all blocks (`infinite_cache_hit_ratio`);
    - ``tokens``: hit tokens / prompt tokens (a hit partial last block counts its tokens);
    - ``full_blocks``: hit blocks / full blocks (partial last blocks left out of both);
    - ``mean_per_request``: the mean over requests of hit tokens / prompt tokens.
    Contiguous-prefix matching as in `infinite_cache_hit_ratio`; requests without ids hit nothing.
    """
    seen: set[int] = set()
    bs = trace.block_size
    hit_blocks = blocks = hit_tokens = tokens = hit_full = full = 0
    per_request = 0.0
    for r in trace.requests:
        n = r.input_tokens
        ids = r.hash_ids if r.hash_ids is not None else ()
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        seen.update(ids)
        nblocks = -(-n // bs)
        hit = min(k * bs, n)
        hit_blocks, blocks = hit_blocks + k, blocks + nblocks
        hit_tokens, tokens = hit_tokens + hit, tokens + n
        hit_full, full = hit_full + min(k, n // bs), full + n // bs
        per_request += hit / n if n else 0.0
    reqs = len(trace.requests)
    return {
        "blocks": round(hit_blocks / blocks, 4) if blocks else 0.0,
        "tokens": round(hit_tokens / tokens, 4) if tokens else 0.0,
        "full_blocks": round(hit_full / full, 4) if full else 0.0,
        "mean_per_request": round(per_request / reqs, 4) if reqs else 0.0,
    }


def trace_stats(trace: Trace) -> dict[str, object]:
    """Summary of a trace: requests, duration (s), prompt and output tokens (total, mean, p50, p99),
    blocks, the infinite-cache block hit ratio, and skipped lines."""
    reqs = trace.requests
    inputs = sorted(r.input_tokens for r in reqs)
    outputs = sorted(r.output_tokens for r in reqs)

    def pct(values: list[int], q: float) -> int:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0

    return {
        "requests": len(reqs),
        "duration_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 3) if reqs else 0.0,
        "block_size": trace.block_size,
        "has_prefix_ids": any(r.hash_ids is not None for r in reqs),
        "input_tokens": {
            "total": sum(inputs),
            "mean": round(sum(inputs) / len(inputs), 1) if inputs else 0.0,
            "p50": pct(inputs, 0.5),
            "p99": pct(inputs, 0.99),
        },
        "output_tokens": {
            "total": sum(outputs),
            "mean": round(sum(outputs) / len(outputs), 1) if outputs else 0.0,
            "p50": pct(outputs, 0.5),
            "p99": pct(outputs, 0.99),
        },
        "blocks": sum(-(-r.input_tokens // trace.block_size) for r in reqs),
        "infinite_cache_block_hit_ratio": round(infinite_cache_hit_ratio(trace), 4),
        "infinite_cache_hit_ratio_variants": hit_ratio_variants(trace),
        "skipped_lines": len(trace.errors),
    }


# --- readers ---


def _detect(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "azure"
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        return "mooncake"
    return "jsonl" if isinstance(head, dict) and head.get("format") == "kvdiet-trace" else "mooncake"


def _header_block_size(path: Path) -> int:
    """The ``block_size`` of a generic trace's header line."""
    block_size = None
    with path.open(encoding="utf-8") as f:
        first = next((text for text in f if text.strip()), "")
    try:
        head = json.loads(first)
        if isinstance(head, dict) and head.get("format") == "kvdiet-trace":
            block_size = head.get("block_size")
    except json.JSONDecodeError:
        pass
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise TraceError(
            f'{path}:1: a generic trace starts with {{"format": "kvdiet-trace", "version": 1, "block_size": B}}'
        )
    return block_size


def _lines(path: Path, *, skip_header: bool) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as f:
        lines = ((n, text) for n, text in enumerate(f, 1) if text.strip())
        if skip_header:
            next(lines, None)
        yield from lines


def _jsonl(path: Path, lines: Iterator[tuple[int, str]], block_size: int, *, generic: bool):
    time_key, scale = ("arrival_s", 1.0) if generic else ("timestamp", 1e-3)
    for n, text in lines:
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            t = _number(obj, time_key) * scale
            inp, out = _count(obj, "input_length"), _count(obj, "output_length")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise ValueError("hash_ids must be a list of integers")
            if len(ids) != -(-inp // block_size):
                raise ValueError(
                    f"{len(ids)} hash_ids for input_length {inp}: expected ceil({inp} / {block_size}) = "
                    f"{-(-inp // block_size)}"
                )
            yield TraceRequest(t, inp, out, tuple(ids), n)
        except (ValueError, TypeError) as exc:
            yield TraceError(f"{path}:{n}: {exc}")


def _azure(path: Path):
    with path.open(encoding="utf-8", newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            yield TraceError(
                f"{path}:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens, got {header}"
            )
            return
        start = None
        for n, row in enumerate(rows, 2):
            try:
                if len(row) != 3:
                    raise ValueError(f"expected 3 fields, got {len(row)}")
                stamp = _azure_time(row[0])
                start = stamp if start is None else start
                inp, out = int(row[1]), int(row[2])
                if inp < 0 or out < 0:
                    raise ValueError("token counts must be >= 0")
                yield TraceRequest((stamp - start).total_seconds(), inp, out, None, n)
            except ValueError as exc:
                yield TraceError(f"{path}:{n}: {exc}")


def _azure_time(text: str) -> dt.datetime:
    """``2023-11-16 18:15:46.6805900``: seven fractional digits (100 ns); Python takes six."""
    head, _, frac = text.strip().partition(".")
    return dt.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)


def _collect(items, strict: bool) -> tuple[list[TraceRequest], list[str]]:
    requests, errors = [], []
    for item in items:
        if isinstance(item, TraceError):
            if strict:
                raise item
            errors.append(str(item))
        else:
            requests.append(item)
    requests.sort(key=lambda r: (r.arrival_s, r.line))
    return requests, errors


def _number(obj: dict, key: str) -> float:
    value = obj.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0 or value != value:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return float(value)


def _count(obj: dict, key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value
