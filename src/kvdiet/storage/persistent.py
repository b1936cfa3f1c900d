"""Persistent ("SSD") tier: global-KV blocks in a local directory, keyed by their chained block hash.

Each entry is one file ``blocks/<hex[:2]>/<hex>.kvb`` (layout and checks: `kvdiet.storage.entry`) with a
TTL (fixed at write time; reads never extend it, see `kvdiet.storage.clock`) and a directory-wide
capacity kept by LRU eviction (least recently read first). The index is SQLite because it ships with
Python (no extra dependency), is ACID, and in WAL mode with a busy timeout is safe for several processes
sharing one directory. The index row is the authority: a file without a row is never served, a row
without a valid file is a miss.

Batches: `put_many` writes every temp file outside any lock, then in one index transaction renames them
over their final names (a reader sees the old file, the new one or none), records them and evicts once;
`get_many` looks its keys up with one SELECT per 500 keys, reads and checks the files outside the lock,
and writes the index at most once. `put` and `get` are batches of one.

No fsync. The tier is a cache: an entry lost to a power failure is recomputed, never served wrong. After
a power loss a renamed file may be empty or torn and the index (WAL, ``synchronous=NORMAL``) may have
lost its last transactions: a torn or empty file fails the length or checksum check (a miss, deleted,
``corrupt_dropped``), a missing one is a plain miss. Measured on the dev machine (ext4, 512 files of
57 KB, temp file + rename): an fsync per file ~1 ms each (0.06 GB/s against 0.63 GB/s without); one
``os.sync()`` per batch 0.21 GB/s, and it flushes every filesystem of the machine; an fsync of the
directory would not make the files' data durable.

Sharing: any number of processes and threads on one machine may use one directory at once (a local
filesystem: SQLite's locks are not reliable over NFS). Every change to the entry files happens inside the
index write transaction that goes with it (a new file is renamed into place in the transaction that records
its row; a file is unlinked in the transaction that deletes its row), so SQLite's write lock orders them
across processes: concurrent writers of one block leave exactly one whole entry (the last to commit; the
others' files are replaced), an eviction or expiry in one process never removes a file another process has
just written, and a committed row always has its file (until a crash or an outside hand removes it: then a
miss). Counters are per process; so are the pending read times below.

A damaged index (``index.sqlite3`` that SQLite cannot read) is not the end of the tier: `open` moves it aside
(``index.sqlite3.damaged-<time>``, under a lock file so processes opening together do it once), starts a new
index and fills it from the entry files' own headers (`kvdiet.storage.index_recovery`), with one warning
naming both files. A new index in a directory that already holds entry files (the index deleted by hand) is
filled the same way. An index written by a newer kvdiet (a higher schema version) is left alone: the tier is
off, and the warning says so.

Read times (LRU) stay in memory until this store's next write transaction (so its own eviction order is
exact), `close`, or 1024 pending reads or 1 s (store clock): one UPDATE batch instead of a commit per
read. Another process's eviction sees them that late at most.

Not known here: what the payload means (the caller packs and unpacks it), how keys are chained, and
which tokens a prompt has (query/hit token counts belong to the cache manager).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.storage.entry import FORMAT_VERSION, KEY_BYTES, EntryCodec, StoreIdentity
from kvdiet.storage.index_recovery import damaged, move_aside, recover_entries

__all__ = ["FORMAT_VERSION", "KEY_BYTES", "PersistentStore", "StoreIdentity"]

_log = logging.getLogger(__name__)

_SCHEMA_VERSION = 1  # PRAGMA user_version of the index
_BUSY_TIMEOUT_S = 30.0
_TEMP_SUFFIX = ".tmp"
_STALE_TEMP_S = 3600.0  # wall-clock age after which sweep() removes a temp file left by a crash
_CHUNK = 500  # keys per ``IN (...)`` query, well under SQLite's limit on bound variables
_PENDING_READS = 1024  # read times held in memory at most ...
_PENDING_READS_S = 1.0  # ... and for this long (store-clock seconds since the oldest)
_Dropped = tuple[bytes, float, bool]  # key, created (of the row read), corrupt (else: file missing)
_ROWS = "SELECT key, identity, size, created, expires FROM entries WHERE key IN"
_LIVE = "SELECT key FROM entries WHERE identity = ? AND expires > ? AND key IN"
_INSERT = (
    "INSERT OR REPLACE INTO entries (key, identity, size, created, expires, last_access)"
    " VALUES (?, ?, ?, ?, ?, ?)"
)


class PersistentStore:
    """Blocks on local disk with a fixed TTL and LRU capacity; thread- and multi-process safe.

    Failures never raise: an OSError or sqlite3.Error while opening or writing logs one warning and
    sets ``enabled = False``, after which puts return False and reads miss. Bad *arguments* raise
    ValueError before any state changes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        identity: StoreIdentity,
        *,
        ttl_s: float = 72 * 3600.0,
        capacity_bytes: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        """No I/O; call `open` (or use ``with``). ``ttl_s`` in seconds (> 0); ``capacity_bytes`` bounds
        the bytes of all entries in the directory (None: unbounded). Raises ValueError on bad values."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.directory = Path(directory)
        self.identity = identity
        self.ttl_s = float(ttl_s)
        self.capacity_bytes = capacity_bytes
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.counters = TierCounters()
        self.enabled = False
        self._tag = identity.tag
        self._codec = EntryCodec(identity)
        self._blocks = str(self.directory / "blocks")
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._reads: dict[bytes, float] = {}  # key -> read time not yet in the index
        self._reads_since = 0.0  # store-clock time of the oldest of them

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory and index; a damaged index is moved aside and rebuilt from the entry files
        (module docstring). On OSError/sqlite3.Error: one warning naming the index file, ``enabled`` stays
        False."""
        with self._lock:
            if self._db is not None:
                return
            index = self.directory / "index.sqlite3"
            try:
                (self.directory / "blocks").mkdir(parents=True, exist_ok=True)
                try:
                    db, recovered = self._connect(index)
                except sqlite3.DatabaseError as exc:
                    if not damaged(exc):
                        raise
                    moved = move_aside(index)
                    db, recovered = self._connect(index)
                    _log.warning(
                        "persistent tier %s: the index %s was unreadable (%s)%s; %s",
                        self.directory,
                        index,
                        exc,
                        f", moved to {moved.name}" if moved else "",
                        _recovered_text(recovered),
                    )
                else:
                    if recovered is not None and (recovered[0] or recovered[1]):
                        _log.warning(
                            "persistent tier %s: no index, %s", self.directory, _recovered_text(recovered)
                        )
            except (OSError, sqlite3.Error) as exc:
                hint = ""
                if isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
                    hint = f"; delete {index} and kvdiet rebuilds it from the entry files"
                _log.warning("persistent tier disabled: cannot open the index %s: %s%s", index, exc, hint)
                return
            self._db = db
            self.enabled = True

    def _connect(self, index: Path) -> tuple[sqlite3.Connection, tuple[int, int] | None]:
        """The index, opened (created with its schema if new, then filled from the entry files). Returns it
        and, for a new index, (entries recovered, files deleted). Raises OSError/sqlite3.Error (closed)."""
        db = sqlite3.connect(
            index,
            timeout=_BUSY_TIMEOUT_S,
            isolation_level=None,  # explicit BEGIN IMMEDIATE transactions
            check_same_thread=False,  # shared by this process's threads under self._lock
        )
        try:
            db.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT_S * 1000)}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            recovered = None
            with _transaction(db):
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, _SCHEMA_VERSION):
                    raise sqlite3.OperationalError(
                        f"index schema version {version}, this kvdiet reads {_SCHEMA_VERSION} (written by a "
                        "newer kvdiet?); use another --persistent-dir or that kvdiet"
                    )
                db.execute(
                    "CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, identity TEXT NOT NULL,"
                    " size INTEGER NOT NULL, created REAL NOT NULL, expires REAL NOT NULL,"
                    " last_access REAL NOT NULL) WITHOUT ROWID"
                )
                db.execute("CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_access, key)")
                db.execute("CREATE INDEX IF NOT EXISTS entries_expires ON entries (expires)")
                if version == 0:  # a new index: the entry files already here become rows again
                    entries, dropped = recover_entries(
                        self.directory / "blocks", ttl_s=self.ttl_s, now=float(self.clock.now())
                    )
                    db.executemany(
                        _INSERT, [(e.key, e.tag, e.size, e.created, e.expires, e.created) for e in entries]
                    )
                    recovered = (len(entries), dropped)
                db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except BaseException:
            with suppress(sqlite3.Error):
                db.close()
            raise
        return db, recovered

    def close(self) -> None:
        """Write the pending read times (best effort) and close the index; the store is disabled until
        opened again. Idempotent."""
        with self._lock:
            self.enabled = False
            if self._db is not None:
                if self._reads:
                    with suppress(sqlite3.Error), _transaction(self._db) as db:
                        self._flush_reads(db)
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
        many items are stored (``len(items)``), or 0 when disabled or on failure: an OSError or
        sqlite3.Error logs one warning, counts one ``write_errors``, disables the store and removes the
        files this batch wrote. Raises ValueError on any bad item, before any state change.
        """
        checked = [self._codec.check_item(item) for item in items]
        if not self.enabled or not checked:
            return 0
        now = float(self.clock.now())
        written: list[tuple[bytes, int, str]] = []  # key, file size (B), temp file (until renamed)
        placed: list[bytes] = []  # keys whose temp file was renamed into place
        recorded = False
        try:
            with self._lock:
                if self._db is None:
                    return 0
                live = {k for (k,) in _select_in(self._db, _LIVE, [k for k, _, _ in checked], self._tag, now)}
            todo: dict[bytes, tuple[list[int], memoryview]] = {}
            for key, tokens, view in checked:
                if key not in live:
                    todo.setdefault(key, (tokens, view))
            for key, (tokens, view) in todo.items():  # the slow part, outside every lock
                head, trailer = self._codec.pack(key, tokens, now, view)
                tmp = _write_temp(self._path(key), (head, view, trailer))
                written.append((key, len(head) + len(view) + len(trailer), tmp))
            if not written:
                return len(checked)
            with self._lock:
                if self._db is None:
                    return 0
                with _transaction(self._db) as db:  # files move with their rows, under the write lock
                    self._flush_reads(db)
                    for key, _, tmp in written:
                        os.replace(tmp, self._path(key))
                        placed.append(key)
                    db.executemany(
                        _INSERT, [(k, self._tag, n, now, now + self.ttl_s, now) for k, n, _ in written]
                    )
                    expired, evicted = self._make_room(db, now)
                    for old in (*expired, *evicted):
                        _unlink(self._path(old))
                recorded = True
                self.counters.entries_written += len(written)
                self.counters.bytes_written += sum(n for _, n, _ in written)
                self.counters.expirations += len(expired)
                self.counters.evictions += len(evicted)
        except (OSError, sqlite3.Error) as exc:
            self._disable("write", exc, write_error=True)
            return 0
        finally:
            if not recorded:
                for key, _, tmp in written:
                    _unlink(self._path(key) if key in placed else tmp)
        return len(checked)

    def sweep(self) -> int:
        """Delete expired entries (rows and files, every identity) and temp files a crash left over
        an hour ago. Returns the number of entries, also added to ``counters.expirations``."""
        if not self.enabled:
            return 0
        now = self.clock.now()
        try:
            with self._lock:
                if self._db is None:
                    return 0
                with _transaction(self._db) as db:
                    self._flush_reads(db)
                    keys = [k for (k,) in db.execute("SELECT key FROM entries WHERE expires <= ?", (now,))]
                    db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
                    for key in keys:
                        _unlink(self._path(key))
                self.counters.expirations += len(keys)
        except sqlite3.Error as exc:
            self._disable("sweep", exc)
            return 0
        self._remove_stale_temp_files()
        return len(keys)

    # ---- reads -----------------------------------------------------------------------------------

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        """The payload stored for ``key`` whose block holds ``tokens``, or None on a miss.

        A miss when disabled, absent, expired (``now >= expires``: the entry is deleted and counted
        in ``expirations``), written by another identity, or its file is missing or fails validation
        (bad magic/version, truncated, checksum, other key or token ids: deleted, ``corrupt_dropped``).
        A hit marks the entry as read (LRU) without extending its TTL. Raises ValueError on bad
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
        hits: list[bytes] = []
        expired: list[bytes] = []  # rows to delete if still expired
        dropped: list[_Dropped] = []  # rows to delete if not rewritten since
        gone: set[bytes] = set()  # keys an earlier item deleted
        nread = 0
        try:
            with self._lock:
                if self._db is None:
                    return out
                self.counters.lookups += len(checked)
                rows = {k: row for k, *row in _select_in(self._db, _ROWS, [k for k, _ in checked])}
            for i, (key, ids) in enumerate(checked):
                if (row := rows.get(key)) is None or key in gone:
                    continue
                identity, size, created, expires = row
                if now >= expires:  # deleted whatever its identity: a read never revives an entry
                    gone.add(key)
                    expired.append(key)
                    continue
                if identity != self._tag:
                    continue
                try:
                    blob = _read_file(self._path(key), size)
                except FileNotFoundError:
                    gone.add(key)
                    dropped.append((key, created, False))
                    continue
                verdict, out[i] = self._codec.unpack(blob, key, ids, created=created)
                if verdict == "corrupt":
                    gone.add(key)
                    dropped.append((key, created, True))
                elif verdict == "ok":
                    hits.append(key)
                    nread += len(blob)
            with self._lock:
                if self._db is None:
                    return [None] * len(checked)
                self._record_reads(self._db, now, hits, expired, dropped)
                self.counters.hits += len(hits)
                self.counters.bytes_read += nread
        except (OSError, sqlite3.Error) as exc:
            self._disable("read", exc)
            return [None] * len(checked)
        return out

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
                live = {k for (k,) in _select_in(self._db, _LIVE, checked, self._tag, now)}
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
        dropped: list[_Dropped],
    ) -> None:
        """Note the read time of ``hits``; in one transaction, when there is anything to delete or the
        pending read times are due: write those, delete the rows of ``expired`` (if still expired) and
        of ``dropped`` (if not rewritten since) and the files of the rows it deleted (missing ones aside).
        Counts expirations and corrupt entries."""
        if hits and not self._reads:
            self._reads_since = now
        self._reads.update(dict.fromkeys(hits, now))
        self.counters.corrupt_dropped += sum(corrupt for _, _, corrupt in dropped)
        due = len(self._reads) >= _PENDING_READS or now - self._reads_since >= _PENDING_READS_S
        if not (expired or dropped or (self._reads and due)):
            return
        with _transaction(db):
            self._flush_reads(db)
            expired = [k for k in expired if _delete(db, "key = ? AND expires <= ?", k, now)]
            dropped = [d for d in dropped if _delete(db, "key = ? AND created = ?", d[0], d[1])]
            for key in (*expired, *(key for key, _, corrupt in dropped if corrupt)):
                _unlink(self._path(key))
        self.counters.expirations += len(expired)

    def _flush_reads(self, db: sqlite3.Connection) -> None:
        """Inside a write transaction: write the pending read times (never moving one back)."""
        if self._reads:
            db.executemany(
                "UPDATE entries SET last_access = max(last_access, ?) WHERE key = ?",
                [(t, k) for k, t in self._reads.items()],
            )
            self._reads.clear()

    def _make_room(self, db: sqlite3.Connection, now: float) -> tuple[list[bytes], list[bytes]]:
        """Inside a write transaction: drop expired rows, then least recently read rows, while the
        entries' bytes exceed ``capacity_bytes``. Returns (expired keys, evicted keys)."""
        if self.capacity_bytes is None:
            return [], []
        total = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
        if total <= self.capacity_bytes:
            return [], []
        expired = db.execute("SELECT key, size FROM entries WHERE expires <= ?", (now,)).fetchall()
        db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
        total -= sum(size for _, size in expired)
        evicted: list[bytes] = []
        cursor = db.execute("SELECT key, size FROM entries ORDER BY last_access, key")
        while total > self.capacity_bytes and (row := cursor.fetchone()) is not None:
            evicted.append(row[0])
            total -= row[1]
        cursor.close()
        db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in evicted])
        return [k for k, _ in expired], evicted

    def _disable(self, what: str, exc: BaseException, *, write_error: bool = False) -> None:
        """Turn the tier off; the warning is logged once, by whoever turns it off."""
        with self._lock:
            if write_error:
                self.counters.write_errors += 1
            was_enabled, self.enabled = self.enabled, False
        if was_enabled:
            hint = ""
            if isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
                index = self.directory / "index.sqlite3"
                hint = (
                    f"; the index {index} is damaged: delete it and kvdiet rebuilds it from the entry files"
                )
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
        name = key.hex()
        return f"{self._blocks}/{name[:2]}/{name}.kvb"

    def _remove_stale_temp_files(self) -> None:
        cutoff = time.time() - _STALE_TEMP_S  # file mtimes are wall-clock, whatever self.clock is
        with suppress(OSError), os.scandir(self._blocks) as subdirs:
            for sub in subdirs:
                with suppress(OSError), os.scandir(sub.path) as files:
                    for f in files:
                        if f.name.endswith(_TEMP_SUFFIX) and f.stat().st_mtime < cutoff:
                            _unlink(f.path)


def _recovered_text(recovered: tuple[int, int] | None) -> str:
    entries, dropped = recovered or (0, 0)
    text = f"rebuilt the index from the entry files: {entries:,} entries"
    return text + (f", {dropped:,} unusable or expired files deleted" if dropped else "")


def _select_in(db: sqlite3.Connection, sql: str, keys: list[bytes], *args: object) -> Iterator[tuple]:
    """Rows of ``sql`` (ending in ``key IN``) for the distinct ``keys``, one query per 500 of them."""
    unique = list(dict.fromkeys(keys))
    for lo in range(0, len(unique), _CHUNK):
        chunk = unique[lo : lo + _CHUNK]
        yield from db.execute(f"{sql} ({','.join('?' * len(chunk))})", (*args, *chunk))


def _delete(db: sqlite3.Connection, where: str, *args: object) -> bool:
    return db.execute(f"DELETE FROM entries WHERE {where}", args).rowcount > 0


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction that takes SQLite's write lock up front (waits up to the busy timeout)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise


def _read_file(path: str, size: int) -> bytes:
    """The bytes of the file at ``path``, expected to be ``size`` long (then one read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size + 1)
        if len(data) <= size:  # a short read of a regular file is its end
            return data
        parts = [data]
        while more := os.read(fd, 1 << 20):
            parts.append(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def _write_temp(path: str, parts: Sequence[bytes | memoryview]) -> str:
    """Write ``parts`` to a uniquely named temp file beside ``path`` (creating its directory) and return
    the temp file's path; the caller renames it over ``path`` (readers see the old file or the new one;
    no fsync: module docstring). Raises OSError (temp removed)."""
    directory, name = os.path.split(path)
    tmp = f"{directory}/.{name.removesuffix('.kvb')}.{os.urandom(6).hex()}{_TEMP_SUFFIX}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            for part in parts:
                view = memoryview(part)
                while view:  # a regular file may take fewer bytes per call
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    """Remove a file; a missing one or a failure leaves an orphan the index never serves."""
    with suppress(OSError):
        os.unlink(path)
