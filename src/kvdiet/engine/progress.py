"""Progress of long work, on stderr: a live bar on a terminal, plain lines at a steady pace elsewhere.

A prefill of a long prompt runs for minutes on a CPU, and so does a trace replay. On a terminal the bar
redraws in place and vanishes at the end; in a file or a pipe (``kvdiet generate ... 2> log``, a CI job,
``nohup``) a bar prints nothing, so one line is written every ``interval_s`` seconds instead, the first one
``interval_s`` after the start (work shorter than that prints nothing) and a last one at the end once any
was written:

    prefill 4,096/35,544 tokens (11.5%), 74.1 s, 55.3 tok/s computed, about 569 s left
    engine bounded-replay 3/8 requests (37.5%), 41.0 s, 0.073 requests/s, about 68 s left

Not known here: what the work is (`ModelRunner.prefill`, the replay command call `advance`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["DEFAULT_INTERVAL_S", "StepProgress", "rate_text"]

DEFAULT_INTERVAL_S = 10.0
"""Seconds between two progress lines when the stream is not a terminal."""


class StepProgress:
    """Reports work of ``total`` steps of which ``done`` are done at the start; a context manager.

    Args:
        total: steps (prompt tokens of a prefill, requests or runs of a replay).
        done: steps done at the start (a prefill's prefix hit: not computed, not in the rate).
        label / unit / rate_unit: how a line names the work, its steps and their rate (default: a prefill
            in tokens, ``tok/s computed``).
        enabled: False → report nothing.
        stream: where to write (default ``sys.stderr``, so stdout keeps only the result).
        interval_s: seconds between lines when ``stream`` is not a terminal (≥ 0; 0 = a line per chunk).
        clock: seconds, monotonic (tests pass a fake one).
    Raises:
        ValueError: ``interval_s`` < 0.
    """

    def __init__(
        self,
        total: int,
        *,
        done: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        label: str = "prefill",
        unit: str = "tokens",
        rate_unit: str = "tok/s computed",
    ) -> None:
        if not interval_s >= 0:
            raise ValueError(f"the progress interval must be >= 0 seconds, got {interval_s}")
        self.total, self.done, self.start_done = total, done, done
        self.enabled, self.interval_s, self.clock = enabled, interval_s, clock
        self.label, self.unit, self.rate_unit = label, unit, rate_unit
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Progress | None = None
        self._task = None
        self._start = self._last = 0.0
        self._lines = 0
        self._written = -1  # ``done`` at the last line

    def __enter__(self) -> StepProgress:
        self._start = self._last = self.clock()
        if self.enabled and _is_terminal(self.stream):
            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                TextColumn(f"{{task.completed}}/{{task.total}} {self.unit}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.done)
        return self

    def advance(self, steps: int) -> None:
        """``steps`` more steps are done (prompt tokens in the cache, requests or runs finished)."""
        self.done += steps
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=steps)
            return
        now = self.clock()
        if now - self._last >= self.interval_s:
            self._last = now
            self._write(now)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.enabled and self._lines and exc_type is None and self._written != self.done:
            self._write(self.clock())

    def _write(self, now: float) -> None:
        elapsed = now - self._start
        computed = self.done - self.start_done
        rate = computed / elapsed if elapsed > 0 else 0.0
        share = 100 * self.done / max(self.total, 1)
        line = f"{self.label} {self.done:,}/{self.total:,} {self.unit} ({share:.1f}%), "
        line += f"{elapsed:.1f} s, {rate_text(rate)} {self.rate_unit}"
        if rate > 0 and self.done < self.total:
            line += f", about {(self.total - self.done) / rate:,.0f} s left"
        print(line, file=self.stream, flush=True)
        self._lines += 1
        self._written = self.done


def rate_text(rate: float) -> str:
    """A progress line's rate: one decimal from 1 up (``2.5``, ``1,234.6``), two significant digits below
    (``0.043``, where one decimal said ``0.0`` for a request every 23 s); ``0.0`` before a step is done."""
    if rate >= 1 or not rate > 0 or not math.isfinite(rate):
        return f"{rate:,.1f}"
    return f"{rate:.{1 - math.floor(math.log10(rate))}f}"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
