"""Agentic session files: coding-agent sessions (a main agent and its nested sub-agents) read into one `Trace`.

The schema (``../shared/traces/agentic-sample/``; one JSON object per session file):

- top level: ``id`` (the session), ``block_size`` (tokens per ``hash_ids`` block, 64), ``hash_id_scope``
  (``"local"``: ids are unique only within the file — a session and its sub-agents share one id space and
  other files reuse the numbers for different content; ``"global"``: one id space for every file),
  ``requests``; other keys (``models``, ``tool_tokens``, ...) are not read.
- a request: ``t`` (seconds since its agent's start), ``type`` (``"s"`` first / ``"n"`` next), ``in`` and
  ``out`` (prompt and output tokens), ``hash_ids`` (one id per *full* block, ``len == in // block_size``;
  ``ceil(in / block_size)`` ids, the last naming the partial block, are accepted too); ``model``, ``ttft``
  and the rest are not read — every request is replayed on the one model the study simulates.
- a sub-agent: ``{"t", "type": "subagent", "agent_id", "requests": [...]}``, its requests' ``t`` relative to
  the sub-agent's start, which is ``t`` after its parent's start; sub-agents may nest.

Ids are made unique across files: each (file, local id) pair — (None, id) under ``"global"`` — gets a fresh
integer from 0 up in reading order (files by name, then depth-first), so a run is deterministic; then they are
chained (`kvdiet.sim.chains`: a block matches only after the same prefix). Sessions
have no absolute start; `SessionStart` places them on one clock. Each request keeps its session (``id``), its
agent (``"main"`` or the sub-agent's ``agent_id``) and its kind (``"agent"`` / ``"subagent"``).

A malformed file (bad JSON: ``file:line:column``) or request (named by its JSON path, e.g.
``session_0001.json: requests[5].requests[2].t: ...``) raises `TraceError` under ``strict``; otherwise it is
skipped, counted in `Trace.errors` (a bad sub-agent entry skips its requests), and reading goes on. An entry
read whose ``t`` is before an earlier one read of its list (an agent's requests and sub-agent starts are in time
order) is counted in `Trace.out_of_order` and re-sorted, or refused under ``strict``, as a JSONL line whose
timestamp goes backwards. This module knows nothing of models or caches; a run's figures per session and kind
are `kvdiet.sim.breakdown`'s.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvdiet.sim.chains import chain_ids
from kvdiet.sim.trace_fields import MAX_REQUEST_TOKENS, count, long_number, number
from kvdiet.sim.trace_file import SESSION_SUFFIXES, gzip_errors, open_text, shorten
from kvdiet.sim.traces import Trace, TraceError, TraceRequest

__all__ = ["SessionStart", "parse_session_start", "read_sessions", "session_reader"]

SESSION_BLOCK_SIZE = 64
"""Tokens per ``hash_ids`` block of the sample files (their ``block_size``); the block size of an empty read."""
POISSON_SEED = 0
"""Seed of the exponential gaps of ``poisson:RATE`` (fixed: the same files give the same trace)."""


@dataclass(frozen=True, slots=True)
class SessionStart:
    """Where session i (files in name order) starts on the trace's clock (seconds).

    Attributes:
        mode: ``together`` (every session at 0), ``staggered`` (session i at ``i × value``) or ``poisson``
            (session 0 at 0, then exponential gaps of mean ``1 / value`` seconds from `POISSON_SEED`).
        value: seconds between starts (staggered) or sessions per second (poisson); unused for together.
    """

    mode: str = "together"
    value: float = 0.0

    def offsets(self, n: int) -> list[float]:
        """The start (seconds) of each of ``n`` sessions; non-decreasing, the first at 0."""
        if self.mode == "staggered":
            return [i * self.value for i in range(n)]
        if self.mode == "poisson":
            rng, t, out = random.Random(POISSON_SEED), 0.0, []
            for _ in range(n):
                out.append(t)
                t += rng.expovariate(self.value)
            return out
        return [0.0] * n

    def __str__(self) -> str:
        return self.mode if self.mode == "together" else f"{self.mode}:{self.value:g}"


MAX_START_VALUE = 1e9
"""The largest ``staggered`` gap (s, ~32 years) or ``poisson`` rate (per s) taken, and the inverse of the least
``poisson`` rate (a mean gap of 1e9 s at most): past a gap of that order start times lose the seconds between a
session's requests to float rounding (``poisson:1e-300`` gave a span of 3e300 s and its sessions' requests all at
one time), and past a rate of 1e9 they stop being finite numbers."""


def parse_session_start(text: str) -> SessionStart:
    """``together``, ``staggered:SECONDS`` (0 to 1e9) or ``poisson:RATE`` (sessions per second, 1e-9 to 1e9).

    Raises:
        ValueError: another form, a non-finite or out-of-range number (one line naming the flag).
    """
    mode, sep, arg = text.strip().partition(":")
    if mode == "together" and not sep:
        return SessionStart()
    if mode in ("staggered", "poisson") and sep:
        try:
            value = float(arg)
        except ValueError:
            value = math.nan
        if (
            math.isfinite(value)
            and (value >= 1 / MAX_START_VALUE if mode == "poisson" else value >= 0)
            and value <= MAX_START_VALUE
        ):
            return SessionStart(mode, value)
    raise ValueError(
        f"--session-start {text!r}: expected together, staggered:SECONDS (0 to 1e9) or poisson:RATE "
        "(sessions per second, 1e-9 to 1e9)"
    )


def session_reader(
    path: str | Path, *, format: str, start: str | None, strict: bool = False
) -> Callable[[], Trace] | None:
    """`read_sessions` of ``path`` as a call without arguments when ``format`` is ``agentic-sessions``, or
    ``auto`` and ``path`` is a folder or a ``.json`` or ``.json.gz`` file (not ``.jsonl``); None for the other
    formats. The
    ``--session-start`` text ``start`` (None: together) is checked now, before any reading.

    Raises:
        ValueError: a bad ``start``, or a ``start`` for another format.
    """
    path = Path(path)
    if format == "agentic-sessions" or (
        format == "auto" and (path.is_dir() or path.name.lower().endswith(SESSION_SUFFIXES))
    ):
        when = parse_session_start("together" if start is None else start)
        return lambda: read_sessions(path, start=when, strict=strict)
    if start is not None:
        raise ValueError("--session-start applies to agentic session files (--format agentic-sessions)")
    return None


def read_sessions(path: str | Path, *, start: SessionStart | None = None, strict: bool = False) -> Trace:
    """Read one session file, or every ``*.json`` and ``*.json.gz`` file of a folder (by name), into a `Trace`
    whose requests
    are in arrival order (ties: file order, then order in the file) and carry session, agent and kind.

    Args:
        path: a session file or a folder of them.
        start: where each session starts (default: all together at 0).
        strict: raise at the first malformed file or request instead of skipping it.
    Raises:
        TraceError: ``strict`` and a malformed file or request, or one whose ``t`` is before an earlier
            entry's of its list (without ``strict`` counted in `Trace.out_of_order`); a folder without
            session files; files whose ``block_size`` differ; two files with the same session ``id``; a
            corrupt or cut-short gzip file (named).
        OSError: a file cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(SESSION_SUFFIXES))
    else:
        files = [path]
    if not files:
        raise TraceError(f"{path}: no session files (*.json, *.json.gz)")
    offsets = (start or SessionStart()).offsets(len(files))
    ids: dict[tuple[int | None, int], int] = {}
    block_size: int | None = None
    sessions: dict[str, Path] = {}
    found: list[tuple[float, int, int, TraceRequest]] = []
    errors: list[str] = []
    late = 0
    for k, (file, offset) in enumerate(zip(files, offsets, strict=True)):
        try:
            top = _top(file)
            if block_size is not None and top["block_size"] != block_size:
                raise TraceError(
                    f"{file}: block_size {top['block_size']} differs from the {block_size} before"
                )
            if top["id"] in sessions:
                raise TraceError(f"{file}: session id {top['id']!r} is also {sessions[top['id']]}'s")
        except TraceError as exc:
            if strict:
                raise
            errors.append(str(exc))
            continue
        block_size = top["block_size"]
        sessions[top["id"]] = file
        scope = k if top["hash_id_scope"] == "local" else None
        fresh = lambda h, s=scope: ids.setdefault((s, h), len(ids))  # noqa: E731
        reader = _Session(file, top["id"], block_size, fresh, strict=strict)
        reader.walk(top["requests"], "requests", offset, "main", "agent")
        if strict and reader.errors:
            raise TraceError(reader.errors[0])
        errors += reader.errors
        late += reader.late
        found += [(r.arrival_s, k, r.line, r) for r in reader.requests]
    found.sort(key=lambda item: item[:3])
    requests = chain_ids([r for *_, r in found])
    return Trace(requests, block_size or SESSION_BLOCK_SIZE, errors, out_of_order=late)


# --- reading one file ---


def _top(file: Path) -> dict:
    """The checked top level of a session file: ``id`` (as a string), ``block_size``, ``hash_id_scope``,
    ``requests``."""
    try:
        with gzip_errors(file, TraceError), open_text(file, errors="strict") as f:
            top = json.load(f)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{file}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    except RecursionError:  # arrays or objects nested past Python's recursion limit
        raise TraceError(f"{file}: JSON nested too deep") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except TraceError:  # a gzip file cut short or corrupt (gzip_errors), named already
        raise
    except ValueError:  # json.load's bare ValueError: an integer literal past Python's digit limit
        raise TraceError(f"{file}: {long_number()}") from None
    if not isinstance(top, dict):
        raise TraceError(f"{file}: a session file is one JSON object, got {type(top).__name__}")
    session = top.get("id")
    if not isinstance(session, str | int) or isinstance(session, bool) or session == "":
        raise TraceError(f"{file}: id must be a non-empty string, got {shorten(session)}")
    bs = top.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool) or not 1 <= bs <= MAX_REQUEST_TOKENS:
        raise TraceError(
            f"{file}: block_size must be an integer in [1, {MAX_REQUEST_TOKENS:,}], got {shorten(bs)}"
        )
    if top.get("hash_id_scope") not in ("local", "global"):
        raise TraceError(
            f'{file}: hash_id_scope must be "local" or "global", got {shorten(top.get("hash_id_scope"))}'
        )
    if not isinstance(top.get("requests"), list):
        raise TraceError(f"{file}: requests must be a list, got {shorten(top.get('requests'))}")
    return top | {"id": str(session)}


class _Session:
    """Flattens one file's requests (depth-first) into `TraceRequest`s with absolute times."""

    def __init__(self, file: Path, session: str, block_size: int, fresh, *, strict: bool) -> None:
        self.file, self.session, self.bs, self.fresh, self.strict = file, session, block_size, fresh, strict
        self.requests: list[TraceRequest] = []
        self.errors: list[str] = []
        self.late = 0  # entries before an earlier entry of their list (times going backwards)

    def walk(self, items: list, where: str, start: float, agent: str, kind: str) -> None:
        """Read ``items`` (the requests of an agent that started at ``start`` seconds on the trace clock); an
        entry read (a skipped one is not) before an earlier one read of ``items`` is counted in ``late`` (an
        error under ``strict``)."""
        latest: tuple[float, str] | None = None  # the latest entry read so far: its time and path
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            try:
                if not isinstance(item, dict):
                    raise ValueError(f"{at}: expected an object, got {type(item).__name__}")
                t = start + number(item, "t", f"{at}.t")
                backwards = latest is not None and t < latest[0]
                if backwards and self.strict:
                    raise ValueError(
                        f"{at}.t: {t - start:g} s is before {latest[1]}'s {latest[0] - start:g} s"
                    )
                if item.get("type") == "subagent":
                    sub, subs = item.get("agent_id"), item.get("requests")
                    if not isinstance(sub, str | int) or isinstance(sub, bool):
                        raise ValueError(f"{at}.agent_id: expected a string, got {shorten(sub)}")
                    if not isinstance(subs, list):
                        raise ValueError(f"{at}.requests: expected a list, got {shorten(subs)}")
                    self.walk(subs, f"{at}.requests", t, str(sub), "subagent")
                elif item.get("type") not in ("s", "n"):
                    raise ValueError(
                        f'{at}.type: expected "s", "n" or "subagent", got {shorten(item.get("type"))}'
                    )
                else:
                    self.requests.append(self._request(item, at, t, agent, kind))
            except ValueError as exc:
                self.errors.append(f"{self.file}: {exc}")
                continue
            self.late += backwards
            latest = latest if backwards else (t, at)

    def _request(self, item: dict, at: str, t: float, agent: str, kind: str) -> TraceRequest:
        n, out = count(item, "in", f"{at}.in"), count(item, "out", f"{at}.out")
        ids = item.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ValueError(f"{at}.hash_ids: expected a list of integers")
        full, every = n // self.bs, -(-n // self.bs)
        if len(ids) not in (full, every):
            raise ValueError(
                f"{at}.hash_ids: {len(ids)} ids for in={n}: expected {n} // {self.bs} = {full} (one per full "
                f"block)" + (f" or {every} (the partial block too)" if every != full else "")
            )
        line = len(self.requests) + 1
        mapped = tuple(self.fresh(h) for h in ids)
        return TraceRequest(t, n, out, mapped, line, session=self.session, agent=agent, kind=kind)
