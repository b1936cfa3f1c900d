"""The SWA pool on Redis: window snapshots shared by every engine process that points at the same servers.

V4.1 keeps window state in a pool made of a slice of every machine's host DRAM with a TTL of minutes,
shared across machines (seed 001, DESIGN.md §1). Redis supplies exactly that: per-key TTLs (``SET … PX``),
``maxmemory`` with ``allkeys-lru`` eviction, and one server per machine (a list of URLs, sharded here by
rendezvous hashing) or a Redis Cluster. Needs Redis ≥ 6.2 (``SET … GET``).

Key layout (``NS`` = the model fingerprint in hex, ``K`` = the pool key in hex; the braces are a Redis
Cluster hash tag, so one snapshot's keys live in one slot and one MULTI/EXEC can write them all)::

    kvdiet:swa:{NS:K}:m           manifest, the commit marker: written last, in the same MULTI/EXEC
    kvdiet:swa:{NS:K}:NONCE:i     chunk i (i = 0 … count−1) of the value, ``chunk_bytes`` each, the last shorter

The manifest's 36 bytes: `kvdiet.storage.redis_manifest`. Values are raw bytes (snapshots); never pickle.

Writes: one MULTI/EXEC per value sets every chunk (``PX ttl + 1 s``: a reader that saw the manifest just
before its deadline still finds the chunks) and then the manifest (``PX ttl``, with ``GET``: an overwritten
manifest's chunks are unlinked right after). A reader thus sees the old value, the new one or none, never
half of one: chunks of another write have another nonce. Reads are two pipelined round trips per server:
every manifest, then every chunk of the valid ones.

A manifest whose chunk is gone (evicted or expired by the server) is a miss counted in ``evictions``; a
manifest or value that fails its checks (length, magic, version, checksums) is a miss counted in
``corrupt_dropped``. Either is deleted, manifest and chunks (those of a manifest that fails its checks are
unknown and left to their TTL), by a script that deletes the manifest only if it still holds the bytes
read: when another writer replaced it meanwhile, the miss is a plain one. The server's own expirations
are invisible (a plain miss): ``expirations`` stays 0.

Failures never raise out of `put`/`get`/`get_many`: a refused connection, a timeout or an error reply
makes the call a miss (None) or a refused put (False), counts ``backend_errors`` (and ``write_errors`` for
a put), logs a warning (once a minute per server at most) and, unless the server answered with an error
about the command itself, skips that server for ``backoff_s`` seconds, so a dead Redis costs at most one
connect timeout per back-off instead of one per request; then the client reconnects by itself. Servers
are independent: a dead one only loses its keys. A server's client, drop script, health fields and memory
statistics are a `kvdiet.storage.redis_server.RedisServer`.

Not known here: what a snapshot holds, how pool keys are derived, and the servers' ``maxmemory`` (the
servers evict, not this client; see the README's deployment section).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.redis_manifest import Manifest, pack_manifest, parse_manifest
from kvdiet.storage.redis_server import RedisServer
from kvdiet.storage.redis_urls import parse_redis_urls, server_id
from kvdiet.storage.swa_pool import DEFAULT_SWA_POOL_TTL_S, SwaPoolBase

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_SOCKET_TIMEOUT_S",
    "RedisSwaPool",
]

_log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
"""1 MiB: a V4.1-Flash window snapshot (2,703,360 B, README) is 3 chunks; small enough that one chunk
never holds the server's single thread for long."""
MAX_CHUNK_BYTES = 512 << 20
"""Redis's largest string (``proto-max-bulk-len`` default, 512 MiB)."""
DEFAULT_BACKOFF_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 0.25
DEFAULT_SOCKET_TIMEOUT_S = 1.0
_CHUNK_GRACE_MS = 1000  # chunks outlive their manifest by this much
_WARN_EVERY_S = 60.0  # at most one warning per server per minute
_STATS_EVERY_S = 1.0  # `nbytes`/`len` ask the servers at most this often
_KEY_PREFIX = "kvdiet:swa:"


@dataclass(slots=True)
class _Read:
    """One key of a `get_many` on its way through the two round trips."""

    index: int
    base: str
    manifest: Manifest | None = None
    verdict: str | None = None  # "evictions" (a chunk gone) or "corrupt_dropped" (failed a check)


class RedisSwaPool(SwaPoolBase):
    """The SWA pool on one or more Redis servers or a Redis Cluster (see the module docstring). Thread-safe.

    Args:
        urls: one Redis URL, a comma-separated list, or a sequence of them (`parse_redis_urls`); keys are
            spread over several servers by rendezvous hashing (the same on every process listing the same
            servers, in any order).
        namespace: the model fingerprint in hex; processes of other models never see these snapshots.
        ttl_s: seconds a snapshot stays servable (server-side ``PX``, millisecond resolution; default 300).
        chunk_bytes: bytes per chunk of a value (default 1 MiB, at most 512 MiB).
        backoff_s: seconds a server is skipped after a failure (default 1; 0 retries at every call).
        connect_timeout_s / socket_timeout_s: seconds to connect / to wait for a reply (defaults 0.25, 1).
    Raises:
        ValueError: a bad URL, an empty namespace or one with braces or whitespace, a TTL or timeout
            not > 0, a chunk size outside 1 B–512 MiB, a negative back-off.

    No I/O until `open`; the counters are as the module docstring says.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        namespace: str,
        ttl_s: float = DEFAULT_SWA_POOL_TTL_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        spec = urls if isinstance(urls, str) else ",".join(urls)
        parsed = parse_redis_urls(spec)
        if not namespace or any(c in namespace for c in "{} \t\r\n"):
            raise ValueError(f"namespace must be non-empty, without braces or whitespace, got {namespace!r}")
        if not ttl_s > 0 or not connect_timeout_s > 0 or not socket_timeout_s > 0:
            raise ValueError(
                f"TTL and timeouts must be > 0 s, got {ttl_s}, {connect_timeout_s}, {socket_timeout_s}"
            )
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if not backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.namespace, self.ttl_s, self.chunk_bytes = namespace, float(ttl_s), chunk_bytes
        self.backoff_s = float(backoff_s)
        self.connect_timeout_s, self.socket_timeout_s = float(connect_timeout_s), float(socket_timeout_s)
        self.counters = TierCounters()
        self._servers = [RedisServer(u, server_id(u).encode()) for u in parsed]
        self._ttl_ms = max(1, round(self.ttl_s * 1000))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = ", ".join(s.name for s in self._servers)
        return f"Redis SWA pool ({where}; TTL {self.ttl_s:g} s, chunks of {self.chunk_bytes:,} B)"

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Connect to every server and PING it. A server that does not answer gets one warning; the pool
        works without it (its keys miss) and reconnects after the back-off. Never raises on I/O."""
        for server in self._servers:
            if server.client is None and self._connect(server, at_start=True) is not None:
                try:
                    server.client.ping()
                except (RedisError, RedisClusterException, OSError) as exc:
                    self._failed(server, exc, "unreachable at start-up")

    def close(self) -> None:
        """Drop every connection; a later call reconnects (`open` again, or any put/get). Idempotent."""
        for server in self._servers:
            client, server.client, server.drop = server.client, None, None
            if client is not None:
                with suppress(Exception):
                    client.close()

    def __enter__(self) -> RedisSwaPool:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def reachable(self) -> bool:
        """Whether the last call to every server succeeded (no I/O)."""
        return not any(s.down for s in self._servers)

    # ---- the SwaPool protocol --------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` (bytes-like) under ``key`` (bytes) for ``ttl_s``, replacing any value there.
        False when the server is down, skipped during a back-off, or the write failed."""
        view = memoryview(value).cast("B")
        server = self._server_for(key)
        client = self._client(server)
        if client is None:
            with self._lock:
                self.counters.write_errors += 1
            return False
        base = self._base(key)
        nonce = os.urandom(8)
        n = len(view)
        chunks = [view[i : i + self.chunk_bytes] for i in range(0, n, self.chunk_bytes)]
        manifest = pack_manifest(nonce, len(chunks), n, zlib.crc32(view))
        try:
            pipe = client.pipeline(transaction=True)
            for i, chunk in enumerate(chunks):
                pipe.set(f"{base}:{nonce.hex()}:{i}", chunk, px=self._ttl_ms + _CHUNK_GRACE_MS)
            pipe.set(f"{base}:m", manifest, px=self._ttl_ms, get=True)
            old = pipe.execute()[-1]
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed(server, exc, "write failed", write=True)
            return False
        self._succeeded(server)
        with self._lock:
            self.counters.entries_written += 1
            self.counters.bytes_written += n
        previous = parse_manifest(old) if old is not None else None
        if previous is not None and previous.nonce != nonce.hex():
            with suppress(RedisError, RedisClusterException, OSError):  # they expire anyway
                client.unlink(*self._chunk_keys(base, previous))
        return True

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a live manifest (one ``EXISTS`` each; no value read, nothing
        counted); a server down or failing ends the run there."""
        for i, key in enumerate(keys):
            server = self._server_for(key)
            try:
                client = self._client(server)
                if client is None or not client.exists(f"{self._base(key)}:m"):
                    return i
            except (RedisError, RedisClusterException, OSError) as exc:
                self._failed(server, exc, "lookup failed")
                return i
        return len(keys)

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[bytes | None]:
        """The value stored under each of ``keys`` (``tokens`` unused), or None: absent, expired, evicted (whole
        or a chunk), corrupt, or the server down (module docstring: the counters). Two round trips per server."""
        out: list[bytes | None] = [None] * len(keys)
        groups: dict[int, list[_Read]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._servers.index(self._server_for(key)), []).append(
                _Read(i, self._base(key))
            )
        with self._lock:
            self.counters.lookups += len(keys)
        for s, reads in groups.items():
            self._read(self._servers[s], reads, out)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the servers use (``INFO memory`` ``used_memory``, every namespace and Redis's own
        overhead), asked at most once a second; 0 for a server that is down."""
        return sum(self._stats(s)[0] for s in self._servers)

    def __len__(self) -> int:
        """Keys in the servers' databases (``DBSIZE``: manifests and chunks of every namespace), asked at
        most once a second; 0 for a server that is down."""
        return sum(self._stats(s)[1] for s in self._servers)

    # ---- internals -------------------------------------------------------------------------------

    def _base(self, key: bytes) -> str:
        return f"{_KEY_PREFIX}{{{self.namespace}:{bytes(key).hex()}}}"

    @staticmethod
    def _chunk_keys(base: str, m: Manifest) -> list[str]:
        return [f"{base}:{m.nonce}:{i}" for i in range(m.chunks)]

    def _server_for(self, key: bytes) -> RedisServer:
        """Rendezvous (highest-random-weight) hashing: the server whose hash with ``key`` is largest."""
        if len(self._servers) == 1:
            return self._servers[0]
        key = bytes(key)
        return max(self._servers, key=lambda s: blake2b(s.ident + b"\0" + key, digest_size=8).digest())

    def _read(self, server: RedisServer, reads: list[_Read], out: list[bytes | None]) -> None:
        """Both round trips for the keys of one server; fills ``out``; failures make misses."""
        client = self._client(server)
        if client is None:
            return
        try:
            pipe = client.pipeline(transaction=False)
            for r in reads:
                pipe.get(f"{r.base}:m")
            raws = pipe.execute()
            pipe = client.pipeline(transaction=False)
            for r, raw in zip(reads, raws, strict=True):
                if raw is None:
                    continue
                r.manifest = parse_manifest(raw)
                if r.manifest is None:  # compared (and deleted) as it was read; its chunks are unknown
                    r.manifest, r.verdict = Manifest(bytes(raw), "", 0, 0, 0), "corrupt_dropped"
                    continue
                for k in self._chunk_keys(r.base, r.manifest):
                    pipe.get(k)
            replies = iter(pipe.execute())
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed(server, exc, "read failed")
            return
        self._succeeded(server)
        hits, nread = 0, 0
        for r in reads:
            m = r.manifest
            if m is None or r.verdict is not None:
                continue
            parts = [next(replies) for _ in range(m.chunks)]
            if any(p is None for p in parts):
                r.verdict = "evictions"
                continue
            value = b"".join(parts)
            if len(value) != m.total or zlib.crc32(value) != m.crc:
                r.verdict = "corrupt_dropped"
                continue
            out[r.index] = value
            hits, nread = hits + 1, nread + len(value)
        with self._lock:
            self.counters.hits += hits
            self.counters.bytes_read += nread
        for r in reads:
            if r.verdict is not None:
                self._drop(server, r)

    def _drop(self, server: RedisServer, r: _Read) -> None:
        """Delete a bad or incomplete entry unless a writer replaced it since it was read; count it if so."""
        m = r.manifest
        try:
            dropped = server.drop(keys=[f"{r.base}:m", *self._chunk_keys(r.base, m)], args=[m.raw])
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed(server, exc, "delete failed")
            dropped = 1  # it was bad when read; the TTL removes it
        if dropped:
            with self._lock:
                setattr(self.counters, r.verdict, getattr(self.counters, r.verdict) + 1)

    def _client(self, server: RedisServer) -> Any:
        """The server's client, or None while it is backed off (or cannot be made)."""
        if server.down and time.monotonic() < server.down_until:
            return None
        if server.client is None:
            return self._connect(server, at_start=False)
        return server.client

    def _connect(self, server: RedisServer, *, at_start: bool) -> Any:
        """Make the server's client (`RedisServer.connect`). None on failure (counted, backed off)."""
        try:
            return server.connect(
                connect_timeout_s=self.connect_timeout_s, socket_timeout_s=self.socket_timeout_s
            )
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed(server, exc, "unreachable at start-up" if at_start else "cannot connect")
            return None

    def _failed(self, server: RedisServer, exc: BaseException, what: str, *, write: bool = False) -> None:
        """Count a failed call; back the server off unless it answered with an error about the command."""
        now = time.monotonic()
        answered = isinstance(exc, ResponseError) and not isinstance(exc, ClusterError)
        with self._lock:
            self.counters.backend_errors += 1
            if write:
                self.counters.write_errors += 1
            if not answered:
                server.down, server.down_until = True, now + self.backoff_s
            warn = now - server.warned_at >= _WARN_EVERY_S
            if warn:
                server.warned_at = now
        if not answered and server.client is not None:
            with suppress(Exception):  # every pooled connection is suspect: reconnect on next use
                server.client.connection_pool.disconnect()
        msg = "SWA pool %s: %s (%s); window-state misses become bounded replay"
        args: tuple = (server.name, what, str(exc).strip() or type(exc).__name__)
        if not answered:
            msg += "; retrying every %g s"
            args += (self.backoff_s,)
        _log.log(logging.WARNING if warn else logging.DEBUG, msg, *args)

    def _succeeded(self, server: RedisServer) -> None:
        if server.down:
            with self._lock:
                was_down, server.down = server.down, False
            if was_down:
                _log.info("SWA pool %s: reachable again", server.name)

    def _stats(self, server: RedisServer) -> tuple[int, int]:
        """(used_memory B, keys) of a server, at most once per `_STATS_EVERY_S`; (0, 0) when down."""
        now = time.monotonic()
        if now - server.stats_at < _STATS_EVERY_S:
            return server.stats
        server.stats_at = now
        client = self._client(server)
        if client is None:
            server.stats = (0, 0)
            return server.stats
        try:
            server.stats = server.query_stats(client)
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed(server, exc, "INFO failed")
            server.stats = (0, 0)
            return server.stats
        self._succeeded(server)
        return server.stats
