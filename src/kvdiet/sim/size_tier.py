"""`SizeTier`: a cache tier of the model-free simulator — the `kvdiet.cache.tier.Tier` protocol over byte sizes.

The values are sizes (ints), the rules are `kvdiet.cache.ttl_lru.TtlLru`'s (the same object the in-process
SWA pool keeps its bytes in), and time is the simulator's trace time (a `ManualClock` it advances). Keys are
`kvdiet.cache.keys.TupleKeys` tuples, so bytes are counted by class: a block's global KV or window state.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvdiet.cache.counters import TierCounters
from kvdiet.cache.keys import KeyKind
from kvdiet.cache.ttl_lru import TtlLru
from kvdiet.storage.clock import ManualClock

__all__ = ["SizeTier", "tier_bytes"]


def _kind(key: Hashable) -> str:
    """The byte class of a key: ``"kv"`` (a block's global KV), ``"window"`` (snapshots, window blocks), or
    ``""`` (the device pool's plain block ids)."""
    if type(key) is not tuple:
        return ""
    return "kv" if key[0] is KeyKind.BLOCK else "window"


def tier_bytes(tier: SizeTier, name: str, span_s: float) -> dict[str, int | float]:
    """A tier's bytes over a run of ``span_s`` seconds, as summary entries named ``<name>_…``: the peak held,
    the total written, byte-hours and the time-averaged bytes held, the bytes held at the end — overall and
    for each byte class (``<name>_kv_…``, ``<name>_window_…``); plus the window share at the peak."""
    e = tier.entries
    out: dict[str, int | float] = {
        f"{name}_bytes_peak": e.peak,
        f"{name}_bytes_written": tier.counters.bytes_written,
        f"{name}_byte_hours": round(e.byte_seconds / 3600, 3),
        f"{name}_bytes_mean": round(e.byte_seconds / span_s) if span_s > 0 else e.nbytes,
        f"{name}_bytes_end": e.nbytes,
    }
    for k in sorted(k for k in {*e.kind_written, *e.kind_bytes} if k):
        out[f"{name}_{k}_bytes_peak"] = e.kind_peak.get(k, 0)
        out[f"{name}_{k}_bytes_written"] = e.kind_written.get(k, 0)
        out[f"{name}_{k}_byte_hours"] = round(e.kind_byte_seconds.get(k, 0.0) / 3600, 3)
    out[f"{name}_window_share_at_peak"] = round(e.peak_kinds.get("window", 0) / e.peak, 4) if e.peak else 0.0
    return out


class SizeTier:
    """Keys with byte sizes under a byte budget, on trace time.

    Args:
        capacity: budget in bytes (None: unbounded).
        ttl: seconds from the write (None: forever).
        refresh: a put of a live key restarts it (the SWA pool) or keeps it (the persistent tier).
        clock: trace time, advanced by the simulator.
    """

    def __init__(self, capacity: int | None, ttl: float | None, *, refresh: bool, clock: ManualClock) -> None:
        self.counters = TierCounters()
        self.entries: TtlLru[int] = TtlLru(capacity, ttl, refresh=refresh, counters=self.counters, kind=_kind)
        self.clock = clock

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def __len__(self) -> int:
        return len(self.entries)

    def get_many(
        self, keys: Sequence[Hashable], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[int | None]:
        now = self.clock.now()
        return [self.entries.get(k, now) for k in keys]

    def put_many(self, items: Sequence[tuple[Hashable, Sequence[int] | None, int]]) -> int:
        return self.entries.put_many([(k, size, size) for k, _, size in items], self.clock.now())

    def discard_many(self, keys: Sequence[Hashable]) -> int:
        """Drop each held key (a superseded snapshot); returns how many were held."""
        now = self.clock.now()
        return sum(self.entries.discard(k, now) for k in keys)

    def contains_prefix(self, keys: Sequence[Hashable]) -> int:
        self.entries.expire(self.clock.now())
        return next((i for i, k in enumerate(keys) if k not in self.entries), len(keys))

    def expire(self) -> None:
        """Drop what has expired by now (so resident bytes are exact at a sample)."""
        self.entries.expire(self.clock.now())

    def close(self) -> None:
        self.entries.clear()
