"""`StepProgress` off a terminal: a line every interval (not every chunk), none for a short prefill, a last
line at the end once any was written, nothing when disabled (issue 18 point 4)."""

from __future__ import annotations

import io

import pytest

from kvdiet.engine.progress import StepProgress


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _run(steps: int, *, seconds_per_step: float, interval_s: float = 10.0, done: int = 0) -> list[str]:
    stream, clock = io.StringIO(), FakeClock()
    with StepProgress(1000 + done, done=done, stream=stream, interval_s=interval_s, clock=clock) as bar:
        for _ in range(steps):
            clock.t += seconds_per_step
            bar.advance(1000 // steps)
    return stream.getvalue().splitlines()


def test_a_line_every_interval_at_a_steady_pace() -> None:
    lines = _run(100, seconds_per_step=1.0)  # 100 chunks of 10 tokens, one a second
    assert len(lines) == 10  # t = 10, 20, ..., 100 s: the last one is the end
    assert lines[0] == "prefill 100/1,000 tokens (10.0%), 10.0 s, 10.0 tok/s computed, about 90 s left"
    assert lines[-1] == "prefill 1,000/1,000 tokens (100.0%), 100.0 s, 10.0 tok/s computed"


def test_a_short_prefill_prints_nothing() -> None:
    assert _run(10, seconds_per_step=0.5) == []


def test_the_end_gets_a_line_and_cached_tokens_are_not_in_the_rate() -> None:
    lines = _run(4, seconds_per_step=7.0, done=24_000)  # lines at 14 s and 28 s (the end)
    assert lines == [
        "prefill 24,500/25,000 tokens (98.0%), 14.0 s, 35.7 tok/s computed, about 14 s left",
        "prefill 25,000/25,000 tokens (100.0%), 28.0 s, 35.7 tok/s computed",
    ]


def test_disabled_or_interrupted() -> None:
    stream, clock = io.StringIO(), FakeClock()
    with StepProgress(10, enabled=False, stream=stream, interval_s=0, clock=clock) as bar:
        bar.advance(10)
    assert stream.getvalue() == ""
    with (
        pytest.raises(KeyboardInterrupt),
        StepProgress(10, stream=stream, interval_s=0, clock=clock) as bar,
    ):
        clock.t += 1
        bar.advance(5)
        raise KeyboardInterrupt
    assert stream.getvalue().splitlines() == [
        "prefill 5/10 tokens (50.0%), 1.0 s, 5.0 tok/s computed, about 1 s left"
    ]
    with pytest.raises(ValueError, match="must be >= 0"):
        StepProgress(10, interval_s=-1)
