"""`SizeTier`: a cache tier of the model-free simulator — the `kvdiet.cache.tier.Tier` protocol over byte sizes.

The values are sizes (ints), the rules are `kvdiet.cache.ttl_lru.TtlLru`'s (the same object the in-process
SWA pool keeps its bytes in), and time is the simulator's trace time (a clock it advances). Keys are
`kvdiet.cache.keys.IdKeys`: a block's global KV under its trace id (an int), window state under a
``(kind, id)`` tuple; so bytes are counted by class — ``"kv"`` or ``"window"`` — read off the key's type (in
C: `type`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvdiet.cache.counters import TierCounters
from kvdiet.cache.ttl_lru import TtlLru
from kvdiet.storage.clock import Clock

__all__ = ["SizeTier", "TraceClock", "class_bytes", "tier_bytes"]


def _classes(per_type: dict) -> dict:
    """Figures by key type → by byte class: ``"kv"`` (a block's global KV: an int key) or ``"window"`` (snapshots,
    window blocks: a tuple key)."""
    return {("kv" if t is int else "window"): n for t, n in per_type.items()}


def tier_bytes(tier: SizeTier, name: str, span_s: float) -> dict[str, int | float]:
    """A tier's bytes over a run of ``span_s`` seconds, as summary entries named ``<name>_…``: the peak held,
    the total written, byte-hours and the time-averaged bytes held, the bytes held at the end — overall and
    for each byte class (``<name>_kv_…``, ``<name>_window_…``; each class's own exact peak); plus the window
    share at the peak."""
    e = tier.entries
    written, peaks = _classes(e.kind_written), _classes(e.kind_peak)
    byte_seconds, at_peak = _classes(e.kind_byte_seconds), _classes(e.peak_kinds)
    out: dict[str, int | float] = {
        f"{name}_bytes_peak": e.peak,
        f"{name}_bytes_written": tier.counters.bytes_written,
        f"{name}_byte_hours": round(e.byte_seconds / 3600, 3),
        f"{name}_bytes_mean": round(e.byte_seconds / span_s) if span_s > 0 else e.nbytes,
        f"{name}_bytes_end": e.nbytes,
    }
    for c in sorted(written):
        out[f"{name}_{c}_bytes_peak"] = peaks.get(c, 0)
        out[f"{name}_{c}_bytes_written"] = written[c]
        out[f"{name}_{c}_byte_hours"] = round(byte_seconds.get(c, 0.0) / 3600, 3)
    out[f"{name}_window_share_at_peak"] = round(at_peak.get("window", 0) / e.peak, 4) if e.peak else 0.0
    return out


def class_bytes(tier: SizeTier) -> dict[str, int]:
    """Bytes held now by byte class (``"kv"``, ``"window"``)."""
    return _classes(tier.entries.kind_bytes)


class SizeTier:
    """Keys with byte sizes under a byte budget, on trace time.

    Args:
        capacity: budget in bytes (None: unbounded).
        ttl: seconds from the write (None: forever).
        refresh: a put of a live key restarts it (the SWA pool) or keeps it (the persistent tier).
        clock: trace time, advanced by the simulator.
    """

    def __init__(self, capacity: int | None, ttl: float | None, *, refresh: bool, clock: Clock) -> None:
        self.counters = TierCounters()
        self.entries: TtlLru[int] = TtlLru(capacity, ttl, refresh=refresh, counters=self.counters, kind=type)
        self.clock = clock

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def __len__(self) -> int:
        return len(self.entries)

    def get_many(
        self, keys: Sequence[Hashable], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[int | None]:
        return self.entries.get_many(keys, self.clock.now())

    def put_many(self, items: Sequence[tuple[Hashable, Sequence[int] | None, int]]) -> int:
        if len(items) == 1:  # a snapshot
            key, _, size = items[0]
            return int(self.entries.put(key, size, size, self.clock.now()))
        if not items:
            return 0
        keys, _, sizes = zip(*items, strict=True)
        return self.entries.put_many(keys, sizes, sizes, self.clock.now())

    def discard_many(self, keys: Sequence[Hashable]) -> int:
        """Drop each held key (a superseded snapshot); returns how many were held."""
        now = self.clock.now()
        return sum(self.entries.discard(k, now) for k in keys)

    def contains_prefix(self, keys: Sequence[Hashable]) -> int:
        return self.entries.held_prefix(keys, self.clock.now())

    def expire(self) -> None:
        """Drop what has expired by now (so resident bytes are exact at a sample)."""
        self.entries.expire(self.clock.now())

    def close(self) -> None:
        self.entries.clear()


class TraceClock:
    """Trace time (seconds) as the tiers read it: moved forward by the simulator only (single-threaded, so no
    lock, unlike `kvdiet.storage.clock.ManualClock`)."""

    __slots__ = ("t",)

    def __init__(self, t: float) -> None:
        self.t = float(t)

    def now(self) -> float:
        return self.t
