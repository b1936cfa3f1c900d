"""`Tiers`: the byte tiers below one engine's device pool, built from its `CacheOptions` — the persistent tier
(``--persistent-dir``), the SWA pool (``--swa-pool``) and the shared global-KV DRAM tier (``--global-pool``) —
opened and closed together. Builds and owns; decides nothing (the rules are
`kvdiet.cache.control.ControlPlane`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiet.cache.options import CacheOptions
from kvdiet.storage.clock import Clock
from kvdiet.storage.entry import StoreIdentity
from kvdiet.storage.mooncake_global import MooncakeGlobalPool, create_global_pool
from kvdiet.storage.persistent import PersistentStore
from kvdiet.storage.swa_pool import SwaPool
from kvdiet.storage.swa_pool_factory import create_swa_pool

__all__ = ["Tiers"]


@dataclass(slots=True)
class Tiers:
    """The tiers of one engine.

    Attributes:
        persistent: the persistent tier, or None.
        swa_pool: the SWA pool.
        global_pool: the shared global-KV DRAM tier, or None.
        owns_swa_pool: this object opens and closes ``swa_pool`` (False for a pool handed in: its owner does).
    """

    persistent: PersistentStore | None
    swa_pool: SwaPool
    global_pool: MooncakeGlobalPool | None
    owns_swa_pool: bool

    @classmethod
    def build(
        cls, opts: CacheOptions, identity: StoreIdentity, *, swa_pool: SwaPool | None, clock: Clock
    ) -> Tiers:
        """The tiers ``opts`` names, for payloads of ``identity`` (its fingerprint namespaces the shared ones);
        ``swa_pool`` replaces the one ``opts.swa_pool`` names. No I/O.

        Raises:
            ValueError: a bad ``--swa-pool`` or ``--global-pool`` spec, size or TTL (named by its flag).
        """
        persistent = (
            PersistentStore(
                opts.persistent_dir,
                identity,
                ttl_s=opts.persistent_ttl_s,
                capacity_bytes=opts.persistent_size,
                clock=clock,
                read_only=opts.persistent_read_only,
            )
            if opts.persistent_dir is not None
            else None
        )
        pool = (  # not ``swa_pool or``: an empty pool has len 0
            swa_pool
            if swa_pool is not None
            else create_swa_pool(
                opts.swa_pool,
                namespace=identity.fingerprint,
                capacity_bytes=opts.swa_pool_size,
                ttl_s=opts.swa_pool_ttl_s,
                clock=clock,
            )
        )
        glob = (
            create_global_pool(
                opts.global_pool,
                identity=identity,
                segment_bytes=opts.global_pool_size,
                ttl_s=opts.global_pool_ttl_s,
                clock=clock,
            )
            if opts.global_pool is not None
            else None
        )
        return cls(persistent, pool, glob, owns_swa_pool=swa_pool is None)

    def open(self) -> None:
        """Open every tier (a failure there only disables the tier or makes it miss, with one warning)."""
        if self.persistent is not None:
            self.persistent.open()
            self.persistent.sweep()  # expired entries leave now (and count), not at their next lookup
        if self.owns_swa_pool:
            self.swa_pool.open()
        if self.global_pool is not None:
            self.global_pool.open()

    def close(self) -> None:
        """Close every tier this object owns; idempotent."""
        if self.persistent is not None:
            self.persistent.close()
        if self.owns_swa_pool:
            self.swa_pool.close()
        if self.global_pool is not None:
            self.global_pool.close()
