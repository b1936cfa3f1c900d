"""The shared global-KV DRAM tier on Mooncake Store (``--global-pool mooncake://HOST[:PORT]``): 64-token blocks
of global KV that every engine naming the same ``mooncake_master`` reads and writes, so a prefix computed on
one machine hits on another. It sits between the device pool and the persistent disk tier
(`kvdiet.cache.control.ControlPlane`: read after the device pool, before the disk; written through as blocks
fill, like the disk). The disk tier stays the durable copy and the 72 h TTL holder; this tier is a cache
with its own TTL (`DEFAULT_GLOBAL_POOL_TTL_S`) and the master's capacity (it evicts from 90% full, oldest
first).

Each value is the header of `kvdiet.storage.mooncake_header` (deadline, length, CRC-32) followed by a whole
persistent-tier entry (`kvdiet.storage.entry.EntryCodec`: magic, format version, a JSON header naming the
model fingerprint, the formats, the block size, the key and the block's token ids, then the payload and its
own CRC-32), under the key ``kvdiet:kv:NS:K`` (``NS`` = the model fingerprint in hex, ``K`` = the block's
chained hash in hex). A read is checked like a persistent entry: a value of another identity (model,
formats, block size), of another key or other token ids (a hash collision), truncated or damaged is a miss
counted in ``corrupt_dropped`` and removed. TTL, upserts, batching, failures as counted misses, back-off and
reconnects are `kvdiet.storage.mooncake_tier.MooncakeTier`'s, shared with the Mooncake SWA pool.

Not known here: what a payload holds, how keys are derived, the order of the tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvdiet.cache.options import DEFAULT_GLOBAL_POOL_TTL_S
from kvdiet.storage.clock import Clock
from kvdiet.storage.entry import EntryCodec, StoreIdentity
from kvdiet.storage.mooncake_tier import MooncakeTier
from kvdiet.storage.mooncake_urls import check_mooncake_spec

__all__ = ["DEFAULT_GLOBAL_POOL_TTL_S", "MooncakeGlobalPool", "create_global_pool"]


class MooncakeGlobalPool(MooncakeTier):
    """The global-KV DRAM tier on one Mooncake Store cluster (see the module docstring): the
    `kvdiet.cache.tier.Tier` calls on blocks. Thread-safe.

    Args:
        url: ``mooncake://HOST[:PORT][?local_host=ADDR]``.
        identity: what the payloads mean (model fingerprint, formats, block size); checked on every read.
        options: ``ttl_s`` (default 1 h), ``segment_bytes`` (default 10% of host RAM; 0: a pure client),
            ``local_buffer_bytes``, ``backoff_s``, ``connect_timeout_s``, ``clock``: as `MooncakeTier`.
    Raises:
        ValueError (naming ``--global-pool``): a bad URL or setting (`MooncakeTier`).

    No I/O until `open`.
    """

    PREFIX = "kvdiet:kv:"
    FLAG = "--global-pool"
    LABEL = "global pool"
    FALLBACK = "global-KV misses continue from the persistent tier or are computed"

    DEFAULT_TTL_S = DEFAULT_GLOBAL_POOL_TTL_S

    def __init__(self, url: str, *, identity: StoreIdentity, **options: Any) -> None:
        super().__init__(url, namespace=identity.fingerprint, **options)
        self.identity = identity
        self._codec = EntryCodec(identity)

    def put_many(self, items: Sequence[tuple[bytes, Sequence[int], bytes]]) -> int:
        """Store each ``(key, tokens, payload)`` (a 32-byte block hash, the block's ``block_size`` token ids,
        the packed global KV) as an entry until now + ``ttl_s``, replacing any value there; returns how many
        were stored (refused writes are counted, never raised).

        Raises:
            ValueError: a bad key, token ids or payload (`EntryCodec.check_item`), before anything is written.
        """
        checked = [self._codec.check_item(item) for item in items]
        now = self.clock.now()
        parts = []
        for key, tokens, view in checked:
            head, trailer = self._codec.pack(key, tokens, now, view)
            parts.append((key, [head, view, trailer]))
        return self._write(parts)

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[bytes | None]:
        """The payload of each block, or None: absent, expired, evicted, of another identity, key or token ids,
        damaged, its owner gone, or the master down (`kvdiet.storage.mooncake_tier`: the counters).

        Raises:
            ValueError: ``tokens`` missing or not one list of ``block_size`` ids per key, or a bad key.
        """
        if tokens is None or len(tokens) != len(keys):
            raise ValueError(f"{self.FLAG}: a read needs the token ids of each of its {len(keys)} blocks")
        asked = [
            (self._codec.check_key(k), self._codec.check_tokens(t)) for k, t in zip(keys, tokens, strict=True)
        ]

        def accept(i: int, body: memoryview) -> bytes | None:
            verdict, payload = self._codec.unpack(body, *asked[i])  # type: ignore[arg-type]
            return payload if verdict == "ok" else None

        return self._read_many([k for k, _ in asked], accept)


def create_global_pool(
    spec: str,
    *,
    identity: StoreIdentity,
    segment_bytes: int | None = None,
    ttl_s: float = DEFAULT_GLOBAL_POOL_TTL_S,
    clock: Clock | None = None,
) -> MooncakeGlobalPool:
    """The global pool ``spec`` (``mooncake://HOST[:PORT]``) names, not opened yet.

    Raises:
        ValueError naming ``--global-pool``: a bad URL, no ``mooncake`` package, a bad size or TTL.
    """
    return MooncakeGlobalPool(
        check_mooncake_spec(spec, flag="--global-pool"),
        identity=identity,
        segment_bytes=segment_bytes,
        ttl_s=ttl_s,
        clock=clock,
    )
