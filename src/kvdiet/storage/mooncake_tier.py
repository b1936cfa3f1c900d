"""`MooncakeTier`: what every kvdiet tier on Mooncake Store shares — the SWA pool
(`kvdiet.storage.mooncake_pool.MooncakeSwaPool`) and the global-KV DRAM tier
(`kvdiet.storage.mooncake_global.MooncakeGlobalPool`): the client and its back-off
(`kvdiet.storage.mooncake_connection`), the TTL kept in each value's header, batched writes and reads, and
the removal of values that fail a check.

Each value is the 32-byte header of `kvdiet.storage.mooncake_header` (magic, version, the deadline, the body's
length and CRC-32) followed by the body, raw bytes, under the key ``PREFIX + NS + ":" + K`` (``NS`` = the model
fingerprint in hex, ``K`` = the tier key in hex). A subclass says what the body is and checks it on a read
(the ``accept`` of `MooncakeTier._read_many`). What Mooncake does not do, kvdiet does here:

- **TTL.** Mooncake has no per-key expiry; the deadline in the header is the TTL (``now < deadline`` is
  served; reads never extend it; wall clock, so machines need NTP-level agreement). An expired value is a
  miss counted in ``expirations`` and is removed. Expired values nobody reads stay until the master's
  eviction (from 90% full, oldest first) reclaims their space.
- **Overwrites.** ``put`` on an existing key keeps the old value; writes here use ``upsert_parts`` (one value:
  header and body parts, no copy into one buffer) or ``batch_upsert_from``, which replace it.
- **Misses vs failures.** ``get`` answers ``b''`` for a missing key, a failed call and an empty value alike,
  so reads go by sizes and return codes instead: one ``batch_get_replica_desc`` gives the sizes of the
  values present (keys it leaves out are checked by ``batch_is_exist``: absent, or a failure with its code),
  then one ``batch_get_into`` reads every present value into buffers of those sizes (no local-buffer limit).
  A value gone between the two (evicted, removed) answers −704: a miss counted in ``evictions``. A value
  whose header, checksum or body check fails is a miss counted in ``corrupt_dropped`` and is removed.

Failures never raise out of a read or a write: each is a miss or a refused put, counted in
``backend_errors`` (and ``write_errors`` for a put), with a warning at most once a minute. When the master
does not answer the tier skips it for ``backoff_s`` seconds, then tries a TCP connection to its port before
calling the client again (`kvdiet.storage.mooncake_connection.MooncakeConnection`).

The segment this process contributes (``segment_bytes``) holds values any client put there, and it goes
with the process: `close` (or an exit) takes those values with it; after a crash the master drops them
within its ``--client_ttl`` (10 s), reads meanwhile fail (a miss). A deployment keeps the pool in one
long-lived ``mooncake_client`` per machine and gives engine processes ``segment_bytes=0`` (README).

Not known here: what a body means, how tier keys are derived, the master's capacity and eviction.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.storage.mooncake_connection import UNREACHABLE, MooncakeConnection
from kvdiet.storage.mooncake_header import HEADER, pack_header, parse_header
from kvdiet.storage.mooncake_urls import MooncakeUrl, parse_mooncake_url
from kvdiet.storage.swa_pool import default_swa_pool_bytes

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_LOCAL_BUFFER_BYTES",
    "MooncakeTier",
]

DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
"""16 MiB, Mooncake's default: a put stages its value here, so the largest value must fit (a V4.1-Flash
window snapshot is about 2.77 MB; Mooncake refuses a larger one with −600)."""
DEFAULT_BACKOFF_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 0.25
_OBJECT_NOT_FOUND = -704

Accept = Callable[[int, memoryview], bytes | None]
"""``accept(i, body)``: the value a read returns for its ``i``-th key from a checked body, or None (corrupt)."""


def _body(index: int, body: memoryview) -> bytes | None:
    return body.tobytes()


def _memory_size(replicas: Sequence[Any]) -> int | None:
    """Bytes of a value from its replica descriptors (the first in memory), None when none is."""
    return next(
        (r.get_memory_descriptor().buffer_descriptor.size for r in replicas if r.is_memory_replica()), None
    )


def _address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


class MooncakeTier:
    """The shared part of a tier on one Mooncake Store cluster (see the module docstring). Thread-safe.

    Class attributes a subclass sets: ``PREFIX`` (of every key name, e.g. ``"kvdiet:swa:"``), ``FLAG`` (the
    command-line flag errors name), ``LABEL`` and ``FALLBACK`` (warnings: the tier, what a miss costs),
    ``DEFAULT_TTL_S`` (seconds).

    Args:
        url: ``mooncake://HOST[:PORT][?local_host=ADDR]`` (`kvdiet.storage.mooncake_urls.parse_mooncake_url`).
        namespace: the model fingerprint in hex; processes of other models never see these values.
        ttl_s: seconds a value stays servable (the deadline in its header; None: ``DEFAULT_TTL_S``).
        segment_bytes: bytes of DRAM this process contributes to the pool (None: 10% of host RAM, like the
            in-process SWA pool; 0: none, a pure client of segments other processes hold).
        local_buffer_bytes: bytes of this process's staging buffer (default 16 MiB; ≥ the largest value).
        backoff_s: seconds the master is skipped after it failed to answer (default 1; 0: retry every call).
        connect_timeout_s: seconds the TCP check of the master's port may take (default 0.25).
        clock: time source of the deadlines (`SystemClock`, wall time, by default).
    Raises:
        ValueError (naming ``FLAG``): a bad URL, an empty namespace or one with ``:`` or whitespace, a TTL or
            timeout not > 0, a negative segment, a local buffer under 1 MiB, a negative back-off.

    No I/O until `open`; Mooncake is imported then (a missing extra is a warning and misses, not an error).
    """

    PREFIX = "kvdiet:"
    FLAG = "--swa-pool"
    LABEL = "Mooncake tier"
    FALLBACK = "reads miss"
    DEFAULT_TTL_S = 300.0

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        ttl_s: float | None = None,
        segment_bytes: int | None = None,
        local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        clock: Clock | None = None,
    ) -> None:
        self.url: MooncakeUrl = parse_mooncake_url(url, flag=self.FLAG)
        ttl_s = self.DEFAULT_TTL_S if ttl_s is None else ttl_s
        segment_bytes = default_swa_pool_bytes() if segment_bytes is None else segment_bytes
        if not namespace or any(c in namespace for c in ": \t\r\n"):
            raise ValueError(f"namespace must be non-empty, without ':' or whitespace, got {namespace!r}")
        if not ttl_s > 0 or not connect_timeout_s > 0:
            raise ValueError(
                f"{self.FLAG}: TTL and timeout must be > 0 s, got {ttl_s} and {connect_timeout_s}"
            )
        if segment_bytes < 0 or local_buffer_bytes < (1 << 20):
            raise ValueError(
                f"{self.FLAG}: need segment_bytes >= 0 and local_buffer_bytes >= 1 MiB, got {segment_bytes} "
                f"and {local_buffer_bytes}"
            )
        if not backoff_s >= 0:
            raise ValueError(f"{self.FLAG}: backoff_s must be >= 0, got {backoff_s}")
        self.namespace, self.ttl_s = namespace, float(ttl_s)
        self.segment_bytes, self.local_buffer_bytes = segment_bytes, local_buffer_bytes
        self.connect_timeout_s = float(connect_timeout_s)
        self.clock = clock or SystemClock()
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._conn = MooncakeConnection(
            self.url,
            segment_bytes=segment_bytes,
            local_buffer_bytes=local_buffer_bytes,
            backoff_s=float(backoff_s),
            connect_timeout_s=self.connect_timeout_s,
            counters=self.counters,
            lock=self._lock,
            label=self.LABEL,
            fallback=self.FALLBACK,
        )

    def __repr__(self) -> str:
        return (
            f"Mooncake {self.LABEL} ({self.url}; TTL {self.ttl_s:g} s, segment {self.segment_bytes:,} B, "
            f"local buffer {self.local_buffer_bytes:,} B)"
        )

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect to the master and mount this process's segment. An unreachable master gets one warning;
        the tier works without it (misses) and connects after the back-off. Never raises on I/O."""
        if self._conn.store is None:
            self._conn.connect(at_start=True)

    def close(self) -> None:
        """Unmount this process's segment (its values leave the pool) and disconnect; a later call connects
        again. Idempotent. Takes Mooncake about 2 s."""
        self._conn.close()

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backoff_s(self) -> float:
        """Seconds the master is skipped after it failed to answer (settable)."""
        return self._conn.backoff_s

    @backoff_s.setter
    def backoff_s(self, seconds: float) -> None:
        self._conn.backoff_s = float(seconds)

    @property
    def reachable(self) -> bool:
        """Whether the last call to the master succeeded (no I/O)."""
        return not self._conn.down

    @property
    def nbytes(self) -> int:
        """0: Mooncake's client reports no pool usage (the master's metrics endpoint does)."""
        return 0

    def __len__(self) -> int:
        """0: Mooncake's client reports no key count (the master's metrics endpoint does)."""
        return 0

    # ---- writes ----------------------------------------------------------------------------------

    def _write(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> int:
        """Store each ``(key, body parts)`` behind a header with the deadline now + ``ttl_s``, replacing any
        value there; returns how many were stored. ``entries_written`` / ``bytes_written`` count the bodies.
        A refused write (master down or backed off, no space: −200, over the local buffer: −600) is counted."""
        if not items:
            return 0
        store = self._conn.client()
        if store is None:
            with self._lock:
                self.counters.write_errors += len(items)
            return 0
        deadline = self.clock.now() + self.ttl_s
        if len(items) == 1:
            key, parts = items[0]
            views = [memoryview(p).cast("B") for p in parts]
            crc, size = 0, 0
            for v in views:
                crc, size = zlib.crc32(v, crc), size + len(v)
            try:
                rc = store.upsert_parts(self._name(key), pack_header(deadline, size, crc), *views)
            except Exception as exc:  # the binding raises only on bad arguments; never into the engine
                rc = exc
            rcs, sizes = [rc], [size]
        else:
            names, bufs = [], []
            for key, parts in items:
                body = b"".join(parts)
                buf = bytearray(pack_header(deadline, len(body), zlib.crc32(body)))
                buf += body
                names.append(self._name(key))
                bufs.append(buf)
            rcs = store.batch_upsert_from(names, [_address(b) for b in bufs], [len(b) for b in bufs])
            sizes = [len(b) - HEADER.size for b in bufs]
        for rc in rcs:
            if rc != 0:
                self._conn.failed(rc, "write failed", write=True)
        stored = [size for size, rc in zip(sizes, rcs, strict=True) if rc == 0]
        if stored:
            self._conn.succeeded()
        with self._lock:
            self.counters.entries_written += len(stored)
            self.counters.bytes_written += sum(stored)
        return len(stored)

    # ---- reads -----------------------------------------------------------------------------------

    def _read_many(self, keys: Sequence[bytes], accept: Accept = _body) -> list[bytes | None]:
        """The value under each of ``keys``, or None: absent, expired, evicted, corrupt, its owner gone, or the
        master down (module docstring: the counters). ``accept(i, body)`` gives the value of ``keys[i]`` from
        a body that passed the header and CRC checks, or None when it fails the caller's own (counted as
        corrupt, removed); by default the body itself. One ``batch_get_replica_desc`` (the sizes), one
        ``batch_is_exist`` of the keys it did not name, one ``batch_get_into``."""
        out: list[bytes | None] = [None] * len(keys)
        with self._lock:
            self.counters.lookups += len(keys)
        store = self._conn.client() if keys else None
        if store is None:
            return out
        where: dict[str, list[int]] = {}  # name -> its indices in ``keys`` (each name is read once)
        for i, k in enumerate(keys):
            where.setdefault(self._name(k), []).append(i)
        present: list[tuple[str, int]] = []  # (name, size)
        drop: list[tuple[str, str]] = []  # (name, counter)
        descs = store.batch_get_replica_desc(list(where))  # absent, or the call failed: left out
        for name in where:
            size = _memory_size(descs.get(name, ()))
            if size is None:
                continue
            if size < HEADER.size:
                drop.append((name, "corrupt_dropped"))
            else:
                present.append((name, size))
        if missing := [n for n in where if n not in descs]:  # absent, or did the call fail? (one more lookup)
            err = min(store.batch_is_exist(missing))
            if err < 0:
                self._conn.failed(err, "lookup failed")
                if err in UNREACHABLE:
                    return out  # the rest would wait on a dead master
        self._conn.succeeded()
        if present:
            self._read(store, where, present, out, drop, accept)
        if drop:
            self._drop(store, drop)
        return out

    def discard_many(self, keys: Sequence[bytes]) -> int:
        """Remove each key's value; returns how many were removed."""
        store = self._conn.client() if keys else None
        if store is None:
            return 0
        return sum(rc == 0 for rc in store.batch_remove([self._name(k) for k in keys], True))

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a value (``batch_is_exist``: an index lookup, so a value past its
        deadline still counts until a read finds it expired); nothing counted. A failure ends the run."""
        store = self._conn.client() if keys else None
        if store is None:
            return 0
        found = store.batch_is_exist([self._name(k) for k in keys])
        if (err := min(found, default=0)) < 0:
            self._conn.failed(err, "lookup failed")
        return next((i for i, e in enumerate(found) if e != 1), len(keys))

    # ---- internals -------------------------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        return f"{self.PREFIX}{self.namespace}:{bytes(key).hex()}"

    def _read(
        self,
        store: Any,
        where: dict[str, list[int]],
        present: list[tuple[str, int]],
        out: list[bytes | None],
        drop: list[tuple[str, str]],
        accept: Accept,
    ) -> None:
        """Read every present value at once into buffers of its size, check it, fill ``out``."""
        bufs = [bytearray(size) for _, size in present]
        rcs = store.batch_get_into(
            [name for name, _ in present], [_address(b) for b in bufs], [len(b) for b in bufs]
        )
        now, hits, nread = self.clock.now(), 0, 0
        for (name, size), buf, rc in zip(present, bufs, rcs, strict=True):
            if rc == _OBJECT_NOT_FOUND:  # gone since its size was read
                with self._lock:
                    self.counters.evictions += 1
                continue
            if rc < 0:
                self._conn.failed(rc, "read failed")
                continue
            if rc != size:  # overwritten with another size meanwhile: a plain miss
                continue
            view = memoryview(buf)
            head = parse_header(view)
            if head is None or zlib.crc32(view[HEADER.size :]) != head.crc:
                drop.append((name, "corrupt_dropped"))
                continue
            if now >= head.deadline:
                drop.append((name, "expirations"))
                continue
            served = 0
            for i in where[name]:
                out[i] = accept(i, view[HEADER.size :])
                served += out[i] is not None
            if served < len(where[name]):
                drop.append((name, "corrupt_dropped"))
            hits, nread = hits + served, nread + head.length * served
        with self._lock:
            self.counters.hits += hits
            self.counters.bytes_read += nread

    def _drop(self, store: Any, drop: list[tuple[str, str]]) -> None:
        """Remove expired or corrupt values (``force``: a read lease does not stop it) and count them."""
        try:
            store.batch_remove([name for name, _ in drop], True)
        except Exception as exc:  # counted below anyway: the value was bad when read
            self._conn.failed(exc, "remove failed")
        with self._lock:
            for _, counter in drop:
                setattr(self.counters, counter, getattr(self.counters, counter) + 1)
