"""`EngineSnapshot`: engine and cache figures at one instant, taken on the engine thread.

The `EngineLoop` takes one between steps (at most every ``refresh_s`` seconds) and publishes it as a single
reference, so a reader on another thread (``GET /metrics``) sees one consistent, immutable set of numbers and
never touches the engine or its tiers. It knows nothing of Prometheus; `kvdiet.server.metrics` names them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdiet.cache.counters import TierCounters

if TYPE_CHECKING:
    from kvdiet.engine.engine import LLMEngine

__all__ = ["EngineSnapshot"]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine and cache figures at one instant (gauges are current values, counters are cumulative since the
    engine started).

    Attributes:
        num_running: requests holding device blocks (gauge).
        num_waiting: requests queued, new or preempted (gauge).
        num_blocks: blocks in the device pool (its size; blocks of ``block_size`` tokens).
        num_used_blocks: device blocks referenced by a request (gauge, blocks).
        num_free_blocks: device blocks free, cached-but-unreferenced included (gauge, blocks).
        num_cached_blocks: device blocks unreferenced but findable by hash (gauge, blocks).
        num_preemptions: requests preempted (counter).
        prompt_tokens: prompt tokens of admitted requests, first admission only (counter, tokens).
        generation_tokens: output tokens generated (counter, tokens).
        device / persistent / swa_pool / global_pool: each tier's counters (a private copy; `TierCounters`
            gives the units; ``global_pool`` all zeros without ``--global-pool``).
        replayed_tokens: tokens recomputed below a prefix hit to rebuild window state (counter, tokens).
        computed_tokens: prompt tokens prefilled, not served by a tier (counter, tokens).
        snapshot_restores: window states restored from a snapshot (counter).
        snapshots_stored: window snapshots stored (counter).
        persistent_bytes / persistent_entries: resident in the persistent tier (gauges, bytes and entries;
            0 when the tier is off).
        swa_pool_bytes / swa_pool_entries: resident in the SWA pool (gauges, bytes and snapshots).
    """

    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    device: TierCounters
    persistent: TierCounters
    swa_pool: TierCounters
    global_pool: TierCounters
    replayed_tokens: int
    computed_tokens: int
    snapshot_restores: int
    snapshots_stored: int
    persistent_bytes: int
    persistent_entries: int
    swa_pool_bytes: int
    swa_pool_entries: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of device blocks referenced, in [0, 1] (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    @classmethod
    def take(cls, engine: LLMEngine, *, resident: EngineSnapshot | None = None) -> EngineSnapshot:
        """Read ``engine`` and its cache now. Call it on the thread that drives the engine.

        Args:
            resident: an earlier snapshot whose figures that cost a scan are kept instead of read again: the
                tier-resident ones (``persistent_bytes``, ``persistent_entries``, ``swa_pool_bytes``,
                ``swa_pool_entries``: a query of the tier each, a table scan or a network call) and
                ``num_cached_blocks`` (a pass over every hashed block: 8 ms at 240,000 blocks); None reads them.
        """
        cache = engine.runner
        blocks, stats, pool = cache.pool.blocks, cache.stats, cache.swa_pool
        persistent = cache.persistent if cache.persistent is not None and cache.persistent.enabled else None
        if resident is not None:
            kept = (resident.persistent_bytes, resident.persistent_entries)
            kept += (resident.swa_pool_bytes, resident.swa_pool_entries)
        else:
            kept = (persistent.nbytes, len(persistent)) if persistent is not None else (0, 0)
            kept += (pool.nbytes, len(pool))
        return cls(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_blocks=blocks.num_blocks,
            num_used_blocks=blocks.num_used,
            num_free_blocks=blocks.num_free,
            num_cached_blocks=blocks.num_cached if resident is None else resident.num_cached_blocks,
            num_preemptions=engine.scheduler.num_preemptions,
            prompt_tokens=engine.stats.prompt_tokens,
            generation_tokens=engine.stats.generation_tokens,
            device=dataclasses.replace(stats.device),
            persistent=dataclasses.replace(stats.persistent),
            swa_pool=dataclasses.replace(stats.swa_pool),
            global_pool=dataclasses.replace(stats.global_pool),
            replayed_tokens=stats.replayed_tokens,
            computed_tokens=stats.computed_tokens,
            snapshot_restores=stats.snapshot_restores,
            snapshots_stored=stats.snapshots_stored,
            persistent_bytes=kept[0],
            persistent_entries=kept[1],
            swa_pool_bytes=kept[2],
            swa_pool_entries=kept[3],
        )
