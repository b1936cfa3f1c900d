"""Counters of one cache tier (plain Python; the server exports them as metrics later).

Token counts (``query_tokens``, ``hit_tokens``) are kept by the cache manager, which knows prompts;
entry and byte counts by the tier itself. Each tier updates its counters under its own lock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["CacheStats", "TierCounters"]


@dataclass(slots=True)
class TierCounters:
    """Cumulative counts of one tier since it was opened.

    Attributes:
        query_tokens: prompt tokens looked up in this tier.
        hit_tokens: of those, tokens served from this tier.
        lookups / hits: entry lookups and entries served.
        entries_written / bytes_written: entries and bytes stored (payload + header).
        bytes_read: bytes read back for hits.
        evictions: entries removed to make room (LRU).
        expirations: entries found or swept past their TTL.
        corrupt_dropped: entries dropped because they failed validation (truncated, checksum,
            wrong fingerprint/format/key, token mismatch).
        write_errors: writes that failed (disk full, unwritable directory, backend down; or one entry whose
            file or folder cannot be used: a directory where its file goes, a file, a dangling symlink or
            another user's folder where its folder goes).
        backend_errors: calls to a remote backend that failed (connection refused or lost, timeout, an
            error reply); each one is also a miss or a write error. Local tiers leave it at 0.
        read_errors: entry reads that failed on that entry alone (its file another user's; a directory, FIFO
            or symlink loop in its place); each one a miss, its row dropped and its file left alone.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    entries_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    expirations: int = 0
    corrupt_dropped: int = 0
    write_errors: int = 0
    backend_errors: int = 0
    read_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class CacheStats:
    """Counters of a whole cache system: one `TierCounters` per tier plus the replay work.

    Attributes:
        device / persistent / swa_pool / global_pool: each tier's counters (``global_pool``: the shared
            global-KV DRAM tier; zeros when there is none).
        replayed_tokens: tokens recomputed below a hit to rebuild window state.
        computed_tokens: prompt tokens prefilled from the hit on.
        snapshot_restores: hits whose window state was restored (not replayed).
        snapshots_stored: window snapshots stored (SWA pool or persistent tier).
    """

    device: TierCounters
    persistent: TierCounters
    swa_pool: TierCounters
    global_pool: TierCounters = field(default_factory=TierCounters)
    replayed_tokens: int = 0
    computed_tokens: int = 0
    snapshot_restores: int = 0
    snapshots_stored: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device.as_dict(),
            "global_pool": self.global_pool.as_dict(),
            "persistent": self.persistent.as_dict(),
            "swa_pool": self.swa_pool.as_dict(),
            "replayed_tokens": self.replayed_tokens,
            "computed_tokens": self.computed_tokens,
            "snapshot_restores": self.snapshot_restores,
            "snapshots_stored": self.snapshots_stored,
        }
