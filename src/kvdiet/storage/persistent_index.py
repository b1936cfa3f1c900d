"""The persistent tier's SQLite index: one row per entry file, the schema and its version, the connection,
write transactions, batched key lookups, eviction down to a byte capacity, and read times written in batches.

SQLite because it ships with Python (no extra dependency), is ACID, and in WAL mode with a busy timeout is
safe for several processes sharing one directory (a local filesystem: SQLite's locks are not reliable over
NFS). A row is ``(key, identity, size, created, expires, last_access)``: a 32-byte key, the writer's identity
tag, the file's size in bytes, and times in store-clock seconds. The schema version is ``PRAGMA
user_version``; an index of a higher version (a newer kvdiet) is refused. A new index is filled from the
entry files' own headers (`kvdiet.storage.index_recovery`).

Not known here: the entry files (`kvdiet.storage.entry_files`), the store's thread lock, logging.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kvdiet.storage.clock import Clock
from kvdiet.storage.index_recovery import recover_entries

__all__ = [
    "INSERT",
    "LIVE",
    "ROWS",
    "PendingReads",
    "connect",
    "connect_read_only",
    "delete",
    "make_room",
    "select_in",
    "transaction",
]

SCHEMA_VERSION = 1  # PRAGMA user_version of the index
BUSY_TIMEOUT_S = 30.0
CHUNK = 500  # keys per ``IN (...)`` query, well under SQLite's limit on bound variables
PENDING_READS = 1024  # read times held in memory at most ...
PENDING_READS_S = 1.0  # ... and for this long (store-clock seconds since the oldest)
ROWS = "SELECT key, identity, size, created, expires FROM entries WHERE key IN"
LIVE = "SELECT key FROM entries WHERE identity = ? AND expires > ? AND key IN"
INSERT = (
    "INSERT OR REPLACE INTO entries (key, identity, size, created, expires, last_access)"
    " VALUES (?, ?, ?, ?, ?, ?)"
)


def connect(
    index: Path, blocks: Path, *, ttl_s: float, clock: Clock
) -> tuple[sqlite3.Connection, tuple[int, int] | None]:
    """The index at ``index``, opened (created with its schema if new, then filled from the entry files under
    ``blocks``, with ``ttl_s`` seconds from each entry's creation). Returns it and, for a new index,
    (entries recovered, files deleted).

    Raises:
        OSError, sqlite3.Error: the connection is closed then; a higher schema version is an
            ``sqlite3.OperationalError`` naming both versions.
    """
    db = sqlite3.connect(
        index,
        timeout=BUSY_TIMEOUT_S,
        isolation_level=None,  # explicit BEGIN IMMEDIATE transactions
        check_same_thread=False,  # shared by the store's threads under its lock
    )
    try:
        db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        _enter_wal(db)
        db.execute("PRAGMA synchronous=NORMAL")
        recovered = None
        with transaction(db):
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.OperationalError(
                    f"index schema version {version}, this kvdiet reads {SCHEMA_VERSION} (written by a "
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
                entries, dropped = recover_entries(blocks, ttl_s=ttl_s, now=float(clock.now()))
                db.executemany(
                    INSERT, [(e.key, e.tag, e.size, e.created, e.expires, e.created) for e in entries]
                )
                recovered = (len(entries), dropped)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        with suppress(sqlite3.Error):
            db.close()
        raise
    return db, recovered


def connect_read_only(index: Path) -> sqlite3.Connection:
    """The index at ``index`` opened for reading only, as an immutable file: no lock taken, no journal or
    shared-memory file made, so it opens on a read-only volume or in a folder this process may not write. Meant
    for a folder no process writes meanwhile (a snapshot): a change made by another process while it is open may
    go unseen, or make a read fail (the store then turns the tier off).

    Raises:
        sqlite3.Error: no index file there (``no index file``), not an index, or one of another schema version
            (named; the connection is closed then).
    """
    if not index.is_file():
        raise sqlite3.OperationalError("no index file (a folder no kvdiet persistent tier has written)")
    db = sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro&immutable=1", uri=True, isolation_level=None,
                         check_same_thread=False)  # fmt: skip
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            raise sqlite3.OperationalError(
                f"index schema version {version}, this kvdiet reads {SCHEMA_VERSION}"
            )
        db.execute("SELECT key, identity, size, created, expires FROM entries LIMIT 1").fetchall()
    except BaseException:
        with suppress(sqlite3.Error):
            db.close()
        raise
    return db


def _enter_wal(db: sqlite3.Connection) -> None:
    """Switch ``db`` to WAL mode. Switching a new database out of rollback mode needs an exclusive lock, and
    SQLite answers "database is locked" at once, without its busy handler, while another process holds any
    lock on it (two processes opening one new directory): retry for up to the busy timeout.

    Raises:
        sqlite3.OperationalError: still locked after ``BUSY_TIMEOUT_S`` seconds, or any other error.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction that takes SQLite's write lock up front (waits up to the busy timeout)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise


def select_in(db: sqlite3.Connection, sql: str, keys: list[bytes], *args: object) -> Iterator[tuple]:
    """Rows of ``sql`` (ending in ``key IN``, e.g. `ROWS`, `LIVE`) for the distinct ``keys``, one query per
    500 of them; ``args`` bind the placeholders before the list."""
    unique = list(dict.fromkeys(keys))
    for lo in range(0, len(unique), CHUNK):
        chunk = unique[lo : lo + CHUNK]
        yield from db.execute(f"{sql} ({','.join('?' * len(chunk))})", (*args, *chunk))


def delete(db: sqlite3.Connection, where: str, *args: object) -> bool:
    """Delete the rows matching ``where``; whether any was."""
    return db.execute(f"DELETE FROM entries WHERE {where}", args).rowcount > 0


def make_room(
    db: sqlite3.Connection, now: float, capacity_bytes: int | None
) -> tuple[list[bytes], list[bytes]]:
    """Inside a write transaction: drop expired rows, then least recently read rows (lowest key first among
    equal read times), while the entries' bytes exceed ``capacity_bytes`` (None: unbounded). Returns
    (expired keys, evicted keys); their files are the caller's to remove."""
    if capacity_bytes is None:
        return [], []
    total = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
    if total <= capacity_bytes:
        return [], []
    expired = db.execute("SELECT key, size FROM entries WHERE expires <= ?", (now,)).fetchall()
    db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
    total -= sum(size for _, size in expired)
    evicted: list[bytes] = []
    cursor = db.execute("SELECT key, size FROM entries ORDER BY last_access, key")
    while total > capacity_bytes and (row := cursor.fetchone()) is not None:
        evicted.append(row[0])
        total -= row[1]
    cursor.close()
    db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in evicted])
    return [k for k, _ in expired], evicted


class PendingReads:
    """Read times (LRU) not yet in the index.

    They stay in memory until the store's next write transaction (so its own eviction order is exact), its
    close, or 1024 pending reads or 1 s (store clock): one UPDATE batch instead of a commit per read. Another
    process's eviction sees them that late at most. Not thread-safe: the store holds its lock.
    """

    def __init__(self) -> None:
        self._reads: dict[bytes, float] = {}  # key -> read time (store-clock seconds)
        self._since = 0.0  # store-clock time of the oldest of them

    def __bool__(self) -> bool:
        return bool(self._reads)

    def note(self, keys: Iterable[bytes], now: float) -> None:
        """Remember that ``keys`` were read at ``now``."""
        keys = list(keys)
        if keys and not self._reads:
            self._since = now
        self._reads.update(dict.fromkeys(keys, now))

    def due(self, now: float) -> bool:
        """Whether the pending read times should be written now (1024 of them, or the oldest 1 s old)."""
        return len(self._reads) >= PENDING_READS or now - self._since >= PENDING_READS_S

    def flush(self, db: sqlite3.Connection) -> None:
        """Inside a write transaction: write the pending read times (never moving one back), forget them."""
        if self._reads:
            db.executemany(
                "UPDATE entries SET last_access = max(last_access, ?) WHERE key = ?",
                [(t, k) for k, t in self._reads.items()],
            )
            self._reads.clear()

    def clear(self) -> None:
        """Forget the pending read times without writing them."""
        self._reads.clear()
