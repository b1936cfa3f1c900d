"""Time source of the tiers' TTLs: the wall clock in service, a manual clock in tests.

Expiry rule used by every tier: an entry written at ``t0`` with TTL ``ttl`` is served while
``now < t0 + ttl`` and is a miss from ``now >= t0 + ttl`` on (exclusive at the deadline). TTLs are fixed:
reads never extend them (case B23).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds (float). Wall time, so deadlines survive a restart of the process."""
        ...


class SystemClock:
    """``time.time()``: persistent-tier deadlines must mean the same thing to the next process."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told (tests). Thread-safe."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def set(self, t: float) -> None:
        """Jump to ``t`` seconds. Raises ValueError when that is earlier than now (time never goes back)."""
        with self._lock:
            if t < self._t:
                raise ValueError(f"ManualClock cannot go back from {self._t} to {t}")
            self._t = float(t)

    def advance(self, dt: float) -> None:
        """Move ``dt`` ≥ 0 seconds forward."""
        if dt < 0:
            raise ValueError(f"ManualClock.advance needs dt >= 0, got {dt}")
        with self._lock:
            self._t += dt
