"""The SWA pool on Mooncake Store: window snapshots in a DRAM pool made of segments that processes on every
machine contribute, found through one ``mooncake_master``.

V4.1 keeps window state in "a distributed memory pool made from 10% of each machine's host DRAM" with a TTL
of minutes (seed 001, DESIGN.md §1); Mooncake Store is the LLM-serving field's own such pool (vLLM's and
SGLang's KV connectors use it). Here it runs over TCP (``mooncake-transfer-engine-non-cuda``, the
``kvdiet[mooncake]`` extra, and Debian's ``libibverbs1``), with P2P handshakes instead of a metadata server.

Each value is the header of `kvdiet.storage.mooncake_header` followed by the snapshot, raw bytes, under the
key ``kvdiet:swa:NS:K`` (``NS`` = the model fingerprint in hex, ``K`` = the pool key in hex). The TTL in that
header, upserts, telling misses from failures, back-off and reconnects, and what a segment owner that exits
takes with it are `kvdiet.storage.mooncake_tier.MooncakeTier`'s, shared with the global-KV DRAM tier.

Not known here: what a snapshot holds, how pool keys are derived, the master's capacity and eviction.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdiet.storage.mooncake_tier import (
    DEFAULT_BACKOFF_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LOCAL_BUFFER_BYTES,
    MooncakeTier,
)
from kvdiet.storage.swa_pool import DEFAULT_SWA_POOL_TTL_S, SwaPoolBase

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_LOCAL_BUFFER_BYTES",
    "MooncakeSwaPool",
]


class MooncakeSwaPool(SwaPoolBase, MooncakeTier):
    """The SWA pool on one Mooncake Store cluster (see the module docstring). Thread-safe.

    Args:
        url: ``mooncake://HOST[:PORT][?local_host=ADDR]`` (`kvdiet.storage.mooncake_urls.parse_mooncake_url`).
        namespace: the model fingerprint in hex; processes of other models never see these snapshots.
        ttl_s: seconds a snapshot stays servable (the deadline in its header; default 300).
        segment_bytes: bytes of DRAM this process contributes to the pool (default 10% of host RAM, like the
            in-process pool; 0: none, a pure client of segments other processes hold).
        local_buffer_bytes: bytes of this process's staging buffer (default 16 MiB; ≥ the largest value).
        backoff_s: seconds the master is skipped after it failed to answer (default 1; 0: retry every call).
        connect_timeout_s: seconds the TCP check of the master's port may take (default 0.25).
        clock: time source of the deadlines (`SystemClock`, wall time, by default).
    Raises:
        ValueError: a bad URL, an empty namespace or one with ``:`` or whitespace, a TTL or timeout not > 0,
            a negative segment, a local buffer under 1 MiB, a negative back-off.

    No I/O until `open`; Mooncake is imported then (a missing extra is a warning and misses, not an error).
    """

    PREFIX = "kvdiet:swa:"
    FLAG = "--swa-pool"
    LABEL = "SWA pool"
    FALLBACK = "window-state misses become bounded replay"
    DEFAULT_TTL_S = DEFAULT_SWA_POOL_TTL_S

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` (bytes-like) under ``key`` (bytes) until now + ``ttl_s``, replacing any value
        there. False when the master is down or backed off, or Mooncake refused the write (no space: −200;
        a value over the local buffer: −600)."""
        return self._write([(key, [value])]) == 1

    def put_many(self, items: Sequence[tuple[bytes, Sequence[int] | None, bytes]]) -> int:
        """`put` each ``(key, tokens, value)`` (``tokens`` unused) in one ``batch_upsert_from`` (each value
        copied once behind its header; per-key return codes); returns how many were stored."""
        return self._write([(key, [value]) for key, _, value in items])

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[bytes | None]:
        """The value stored under each of ``keys`` (``tokens`` unused), or None: absent, expired, evicted,
        corrupt, its owner gone, or the master down (`kvdiet.storage.mooncake_tier`: the counters)."""
        return self._read_many(keys)

    def discard_many(self, keys: Sequence[bytes]) -> int:
        """Remove each key's value (a superseded snapshot); returns how many were removed."""
        return MooncakeTier.discard_many(self, keys)
