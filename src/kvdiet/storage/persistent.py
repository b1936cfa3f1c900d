"""Persistent ("SSD") tier: global-KV blocks in a local directory, keyed by their chained block hash.

Each entry is one file ``blocks/<hex[:2]>/<hex>.kvb`` (layout and checks: `kvdiet.storage.entry`; written,
read and removed by `kvdiet.storage.entry_files`, without fsync: why, there) with a TTL (fixed at write time;
reads never extend it, see `kvdiet.storage.clock`) and a directory-wide capacity kept by LRU eviction (least
recently read first). The index (SQLite, `kvdiet.storage.persistent_index`) has one row per entry and is the
authority: a file without a row is never served, a row without a valid file is a miss.

Batches: `put_many` writes every temp file outside any lock, then in one index transaction renames them
over their final names (a reader sees the old file, the new one or none), records them and evicts once;
`get_many` looks its keys up with one SELECT per 500 keys, reads and checks the files outside the lock,
and writes the index at most once. `put` and `get` are batches of one.

Sharing: any number of processes and threads on one machine may use one directory at once (a local
filesystem: SQLite's locks are not reliable over NFS). Every change to the entry files happens inside the
index write transaction that goes with it (a new file is renamed into place in the transaction that records
its row; a file is unlinked in the transaction that deletes its row), so SQLite's write lock orders them
across processes: concurrent writers of one block leave exactly one whole entry (the last to commit; the
others' files are replaced), an eviction or expiry in one process never removes a file another process has
just written, and a committed row always has its file (until a crash or an outside hand removes it: then a
miss). Counters are per process; so are the pending read times (`persistent_index.PendingReads`).

A damaged index, an index of a newer kvdiet, and read-only opening: `kvdiet.storage.index_open`. One entry whose
file or folder cannot be used (`entry_files.ENTRY_FAULTS`) is a miss (``read_errors``) or not stored
(``write_errors``): the tier stays on.

Not known here: what the payload means (the caller packs and unpacks it), how keys are chained, and
which tokens a prompt has (query/hit token counts belong to the cache manager).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.storage.entry import FORMAT_VERSION, KEY_BYTES, EntryCodec, StoreIdentity
from kvdiet.storage.entry_files import (
    ENTRY_FAULTS,
    entry_path,
    place,
    remove_stale_temp_files,
    unlink,
    write_temp,
)
from kvdiet.storage.entry_reads import Dropped, read_entries
from kvdiet.storage.index_open import open_index
from kvdiet.storage.index_recovery import damaged_hint
from kvdiet.storage.persistent_index import (
    INSERT,
    LIVE,
    ROWS,
    PendingReads,
    delete,
    make_room,
    select_in,
    transaction,
)

__all__ = ["FORMAT_VERSION", "KEY_BYTES", "PersistentStore", "StoreIdentity"]

_log = logging.getLogger(__name__)
_ENTRY_WARNINGS = 20  # warnings of single entries that cannot be read or written, a process


class PersistentStore:
    """Blocks on local disk with a fixed TTL and LRU capacity; thread- and multi-process safe.

    Failures never raise: an OSError or sqlite3.Error while opening or writing logs one warning and
    sets ``enabled = False``, after which puts return False and reads miss. Bad *arguments* raise
    ValueError before any state changes. ``read_only``: see the module docstring (puts return False then).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        identity: StoreIdentity,
        *,
        ttl_s: float = 72 * 3600.0,
        capacity_bytes: int | None = None,
        clock: Clock | None = None,
        read_only: bool = False,
    ) -> None:
        """No I/O; call `open` (or use ``with``). ``ttl_s`` in seconds (> 0); ``capacity_bytes`` bounds
        the bytes of all entries in the directory (None: unbounded); ``read_only``: never write the directory.
        Raises ValueError on bad values."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.directory = Path(directory).expanduser()  # "~/kv" as a shell would read it
        self.identity = identity
        self.ttl_s = float(ttl_s)
        self.capacity_bytes = capacity_bytes
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.counters = TierCounters()
        self.enabled, self.read_only = False, read_only
        self._tag = identity.tag
        self._codec = EntryCodec(identity)
        self._blocks = str(self.directory / "blocks")
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._reads = PendingReads()
        self._corrupt_kept: set[bytes] = set()  # read-only: the corrupt entries found (counted once)
        self._warned = 0  # entry warnings logged (`_warn_entries`)

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Open the index (`kvdiet.storage.index_open.open_index`: made where new, a damaged one moved aside and
        rebuilt from the entry files; read-only where asked or where it may not be written). Where it cannot be:
        one warning naming the index file, ``enabled`` stays False."""
        with self._lock:
            if self._db is not None:
                return
            opened = open_index(
                self.directory,
                Path(self._blocks),
                ttl_s=self.ttl_s,
                clock=self.clock,
                read_only=self.read_only,
            )
            if opened is not None:
                (self._db, self.read_only), self.enabled = opened, True

    def close(self) -> None:
        """Write the pending read times (best effort) and close the index; the store is disabled until
        opened again. Idempotent."""
        with self._lock:
            self.enabled = False
            if self._db is not None:
                if self._reads:
                    with suppress(sqlite3.Error), transaction(self._db) as db:
                        self._reads.flush(db)
                with suppress(sqlite3.Error):
                    self._db.close()
                self._db = None
            self._reads.clear()

    def __enter__(self) -> PersistentStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes ----------------------------------------------------------------------------------

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> bool:
        """Store ``payload`` (bytes-like) for ``key`` (32 B) covering ``tokens`` (``block_size`` ids):
        `put_many` of one item. True when stored (or already), False when disabled or the write failed.
        Raises ValueError on bad arguments, before any state change."""
        return self.put_many([(key, tokens, payload)]) == 1

    def put_many(self, items: Sequence[tuple[bytes, Sequence[int], bytes]]) -> int:
        """Store each ``(key, tokens, payload)``: a 32 B key, ``block_size`` token ids, a bytes-like payload.

        Writes every file (temp file, rename), records them all in one index transaction, then evicts
        least recently read entries down to capacity once (this batch's entries are the most recent;
        among them the lowest keys go first). An unexpired entry of this identity is kept as is (its TTL
        is not extended); a key repeated in the batch is written once, from its first item. Returns how
        many items are stored (``len(items)`` less those whose file or folder cannot be used,
        `entry_files.ENTRY_FAULTS`: a ``write_errors`` each), or 0 when disabled or on failure: any other
        OSError or an sqlite3.Error logs one warning, counts one ``write_errors``, disables the store and
        removes the files this batch wrote. Raises ValueError on any bad item, before any state change.
        """
        checked = [self._codec.check_item(item) for item in items]
        if not self.enabled or not checked or self.read_only:
            return 0
        now = float(self.clock.now())
        written: list[tuple[bytes, int, str]] = []  # key, file size (B), temp file (until renamed)
        placed: set[bytes] = set()  # keys whose temp file was renamed into place
        blocked: list[tuple[bytes, OSError]] = []  # keys whose file or folder cannot be used: not stored
        recorded = False
        try:
            with self._lock:
                if self._db is None:
                    return 0
                live = {k for (k,) in select_in(self._db, LIVE, [k for k, _, _ in checked], self._tag, now)}
            todo: dict[bytes, tuple[list[int], memoryview]] = {}
            for key, tokens, view in checked:
                if key not in live:
                    todo.setdefault(key, (tokens, view))
            for key, (tokens, view) in todo.items():  # the slow part, outside every lock
                head, trailer = self._codec.pack(key, tokens, now, view)
                try:
                    tmp = write_temp(self._path(key), (head, view, trailer))
                except ENTRY_FAULTS as exc:  # this entry's folder alone (a file there, another user's)
                    blocked.append((key, exc))
                    continue
                written.append((key, len(head) + len(view) + len(trailer), tmp))
            with self._lock:
                if self._db is None:
                    return 0
                if written:
                    with transaction(self._db) as db:  # files move with their rows, under the write lock
                        self._reads.flush(db)
                        for key, _, tmp in written:
                            if (exc := place(tmp, self._path(key))) is None:
                                placed.add(key)
                            else:
                                blocked.append((key, exc))
                        stored = [(k, n) for k, n, _ in written if k in placed]
                        db.executemany(
                            INSERT, [(k, self._tag, n, now, now + self.ttl_s, now) for k, n in stored]
                        )
                        expired, evicted = make_room(db, now, self.capacity_bytes)
                        for old in (*expired, *evicted):
                            unlink(self._path(old))
                    self.counters.entries_written += len(stored)
                    self.counters.bytes_written += sum(n for _, n in stored)
                    self.counters.expirations += len(expired)
                    self.counters.evictions += len(evicted)
                recorded = True
                self.counters.write_errors += len(blocked)
        except (OSError, sqlite3.Error) as exc:
            self._disable("write", exc, write_error=True)
            return 0
        finally:
            if not recorded:
                for key, _, tmp in written:
                    unlink(self._path(key) if key in placed else tmp)
        return self._stored(checked, blocked)

    def sweep(self) -> int:
        """Delete expired entries (rows and files, every identity) and temp files a crash left over
        an hour ago. Returns the number of entries, also added to ``counters.expirations`` (0 read-only)."""
        if not self.enabled or self.read_only:
            return 0
        now = self.clock.now()
        try:
            with self._lock:
                if self._db is None:
                    return 0
                with transaction(self._db) as db:
                    self._reads.flush(db)
                    keys = [k for (k,) in db.execute("SELECT key FROM entries WHERE expires <= ?", (now,))]
                    db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
                    for key in keys:
                        unlink(self._path(key))
                self.counters.expirations += len(keys)
        except sqlite3.Error as exc:
            self._disable("sweep", exc)
            return 0
        remove_stale_temp_files(self._blocks)
        return len(keys)

    # ---- reads -----------------------------------------------------------------------------------

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        """The payload stored for ``key`` whose block holds ``tokens``, or None on a miss.

        A miss when disabled, absent, expired (``now >= expires``: the entry is deleted and counted
        in ``expirations``), written by another identity, or its file is missing or fails validation
        (bad magic/version, truncated, checksum, other key or token ids: deleted, ``corrupt_dropped``),
        or unreadable (another user's, a directory there: ``read_errors``, its row dropped, the file left
        alone). A hit marks the entry as read (LRU) without extending its TTL. Raises ValueError on bad
        arguments only, never on bad data.
        """
        return self.get_many([key], [tokens])[0]

    def get_many(self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> list[bytes | None]:
        """`get` for each ``(keys[i], tokens[i])`` in order: the same answers and counters as one `get`
        after another (a key an earlier item deleted is a plain miss), at one clock reading. Raises
        ValueError on bad arguments (checked for all of them before any lookup)."""
        if len(keys) != len(tokens):
            raise ValueError(f"{len(keys)} keys but {len(tokens)} token lists")
        codec = self._codec
        checked = [(codec.check_key(k), codec.check_tokens(t)) for k, t in zip(keys, tokens, strict=True)]
        out: list[bytes | None] = [None] * len(checked)
        if not self.enabled or not checked:
            return out
        now = self.clock.now()
        try:
            with self._lock:
                if self._db is None:
                    return out
                self.counters.lookups += len(checked)
                rows = {k: tuple(row) for k, *row in select_in(self._db, ROWS, [k for k, _ in checked])}
            found = read_entries(checked, rows, now=now, tag=self._tag, codec=codec, path_of=self._path)
            with self._lock:
                if self._db is None:
                    return out
                if not self.read_only:
                    self._record_reads(self._db, now, found.hits, found.expired, found.dropped)
                else:
                    self._note_corrupt_kept(found.dropped)
                self.counters.hits += len(found.hits)
                self.counters.bytes_read += found.nread
                self.counters.read_errors += len(found.unreadable)
        except (OSError, sqlite3.Error) as exc:
            self._disable("read", exc)
            return [None] * len(checked)
        self._warn_entries("cannot be read (a miss)", found.unreadable)
        return found.out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have an unexpired entry of this identity (index only: no file is
        read, nothing is deleted or counted). Raises ValueError on a key that is not 32 bytes."""
        checked = [self._codec.check_key(k) for k in keys]
        if not self.enabled:
            return 0
        now = self.clock.now()
        try:
            with self._lock:
                if self._db is None:
                    return 0
                live = {k for (k,) in select_in(self._db, LIVE, checked, self._tag, now)}
        except sqlite3.Error as exc:
            self._disable("lookup", exc)
            return 0
        return next((i for i, key in enumerate(checked) if key not in live), len(checked))

    @property
    def nbytes(self) -> int:
        """Bytes of the entry files in the directory (all identities, expired but unswept included)."""
        return self._scalar("SELECT COALESCE(SUM(size), 0) FROM entries")

    def __len__(self) -> int:
        """Entries in the directory (all identities, expired but unswept included)."""
        return self._scalar("SELECT COUNT(*) FROM entries")

    # ---- internals (those taking ``db`` run under self._lock) ------------------------------------

    def _record_reads(
        self,
        db: sqlite3.Connection,
        now: float,
        hits: list[bytes],
        expired: list[bytes],
        dropped: list[Dropped],
    ) -> None:
        """Note the read time of ``hits``; in one transaction, when there is anything to delete or the
        pending read times are due: write those, delete the rows of ``expired`` (if still expired) and
        of ``dropped`` (if not rewritten since) and the files of the rows it deleted (missing ones aside).
        Counts expirations and corrupt entries."""
        self._reads.note(hits, now)
        self.counters.corrupt_dropped += sum(corrupt for _, _, corrupt in dropped)
        if not (expired or dropped or (self._reads and self._reads.due(now))):
            return
        with transaction(db):
            self._reads.flush(db)
            expired = [k for k in expired if delete(db, "key = ? AND expires <= ?", k, now)]
            dropped = [d for d in dropped if delete(db, "key = ? AND created = ?", d[0], d[1])]
            for key in (*expired, *(key for key, _, corrupt in dropped if corrupt)):
                unlink(self._path(key))
        self.counters.expirations += len(expired)

    def _note_corrupt_kept(self, dropped: list[Dropped]) -> None:
        """Read-only: each corrupt entry counted once (``corrupt_dropped``, its file left in place), and warned of."""
        if new := {key for key, _, corrupt in dropped if corrupt} - self._corrupt_kept:
            self._corrupt_kept |= new
            self.counters.corrupt_dropped += len(new)
            _log.warning("read-only persistent tier %s: corrupt entries kept: %d", self.directory, len(new))

    def _stored(
        self, checked: list[tuple[bytes, list[int], memoryview]], blocked: list[tuple[bytes, OSError]]
    ) -> int:
        """`put_many`'s count: its items but those of a key that could not be written, which are warned of."""
        self._warn_entries("cannot be written (not stored)", blocked)
        refused = {key for key, _ in blocked}
        return sum(key not in refused for key, _, _ in checked)

    def _warn_entries(self, what: str, failed: list[tuple[bytes, OSError]]) -> None:
        """A warning an entry, the first `_ENTRY_WARNINGS` of a store (the counters count all), then one more."""
        for key, exc in dict(failed).items():
            if self._warned < _ENTRY_WARNINGS:
                _log.warning("persistent tier %s: entry %s %s: %s", self.directory, key.hex(), what, exc)
            elif self._warned == _ENTRY_WARNINGS:
                _log.warning("persistent tier %s: more entries fail; only counted from here", self.directory)
            self._warned += 1

    def _disable(self, what: str, exc: BaseException, *, write_error: bool = False) -> None:
        """Turn the tier off; the warning is logged once, by whoever turns it off."""
        with self._lock:
            if write_error:
                self.counters.write_errors += 1
            was_enabled, self.enabled = self.enabled, False
        if was_enabled:
            hint = damaged_hint(exc, self.directory / "index.sqlite3")
            _log.warning(
                "persistent tier disabled after a %s error in %s: %s%s", what, self.directory, exc, hint
            )

    def _scalar(self, sql: str) -> int:
        try:
            with self._lock:
                return 0 if self._db is None else int(self._db.execute(sql).fetchone()[0])
        except sqlite3.Error as exc:
            self._disable("index", exc)
            return 0

    def _path(self, key: bytes) -> str:
        return entry_path(self._blocks, key)
