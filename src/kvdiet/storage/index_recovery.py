"""Recovery of the persistent tier's index: a damaged one moved aside, its rows recovered from the entry files
(each carries its own header).

`kvdiet.storage.persistent` keeps one SQLite row per entry file. When SQLite cannot read the index
(`damaged`), the store moves it aside (`move_aside`); when the index is new (moved aside, or deleted by hand
while entry files remain), the store fills it from `recover_entries`: every ``blocks/*/*.kvb`` file whose
header parses (magic, format version, header JSON naming its key, identity and creation time) becomes a row
again, of whichever identity wrote it. The TTL is the opening store's, counted from the entry's creation
time (the writer's TTL is not in the header); the LRU order restarts from creation times. Only headers are
read: a damaged payload is still found, dropped and counted by the first read, as always. A file whose
header does not parse, whose name is not its key, or that has expired is deleted (an index never serves a
file without a row, so it could only take disk space). `damaged_hint` and `recovered_text` are the words the
store's warnings use for both.

Not known here: the index's schema, TTL or LRU rules, what a payload means.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from kvdiet.storage.entry import FORMAT_VERSION, KEY_BYTES, MAGIC, PREFIX, StoreIdentity

__all__ = ["RecoveredEntry", "damaged", "damaged_hint", "move_aside", "recover_entries", "recovered_text"]

_MAX_HEADER_BYTES = 1 << 20  # a block's header holds its token ids: tens of KB at most


@dataclass(frozen=True, slots=True)
class RecoveredEntry:
    """One index row: key (32 B), identity tag, file size (B), created and expires (store-clock seconds)."""

    key: bytes
    tag: str
    size: int
    created: float
    expires: float


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite says the file is not a database or is corrupt (not: locked, unwritable, full)."""
    return getattr(exc, "sqlite_errorname", "") in ("SQLITE_NOTADB", "SQLITE_CORRUPT")


def damaged_hint(exc: BaseException, index: Path) -> str:
    """What to tell the user after ``exc`` when it says ``index`` is damaged (`damaged`): delete it, kvdiet
    rebuilds it; else nothing (an empty string)."""
    if isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
        return f"; the index {index} is damaged: delete it and kvdiet rebuilds it from the entry files"
    return ""


def move_aside(index: Path) -> Path | None:
    """Rename a damaged ``index`` to ``<name>.damaged-<UTC time>`` (its WAL and shared-memory files are
    deleted), under an exclusive lock on ``<name>.lock``; None when, once the lock is held, the file reads
    fine (another process got there first). Raises OSError."""
    with open(index.with_name(index.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            probe = sqlite3.connect(index)
            try:
                probe.execute("PRAGMA quick_check(1)").fetchall()
                return None
            finally:
                probe.close()
        except sqlite3.DatabaseError as exc:
            if not damaged(exc):
                raise OSError(f"cannot check the index {index}: {exc}") from None
        moved = index.with_name(f"{index.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        os.replace(index, moved)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.unlink(f"{index}{suffix}")
        return moved


def recover_entries(blocks: Path, *, ttl_s: float, now: float) -> tuple[list[RecoveredEntry], int]:
    """Scan ``blocks`` (the store's ``blocks/`` directory) for entry files.

    Returns:
        (entries to index, number of files deleted: unparsable, misnamed or expired). Temp files of
        unfinished writes are left to `PersistentStore.sweep`.
    Raises:
        OSError: the directory cannot be listed.
    """
    entries: list[RecoveredEntry] = []
    dropped = 0
    if not blocks.is_dir():
        return entries, dropped
    for sub in sorted(blocks.iterdir()):
        if not sub.is_dir():
            continue
        for path in sorted(sub.glob("*.kvb")):
            entry = _recover(path, ttl_s)
            if entry is None or entry.expires <= now:
                with contextlib.suppress(OSError):
                    path.unlink()
                dropped += 1
            else:
                entries.append(entry)
    return entries, dropped


def _recover(path: Path, ttl_s: float) -> RecoveredEntry | None:
    """The row of one entry file from its header, or None when the header is not a valid one."""
    try:
        with path.open("rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                return None
            magic, version, head_len = PREFIX.unpack(prefix)
            if magic != MAGIC or version != FORMAT_VERSION or head_len > _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(head_len).decode())
            size = os.fstat(f.fileno()).st_size
        key = bytes.fromhex(header["key"])
        identity = StoreIdentity(header["fingerprint"], tuple(header["formats"]), header["block_size"])
        created = float(header["created"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(key) != KEY_BYTES or path.name != f"{key.hex()}.kvb" or not math.isfinite(created):
        return None
    return RecoveredEntry(key, identity.tag, size, created, created + ttl_s)


def recovered_text(recovered: tuple[int, int] | None) -> str:
    """The warning's words for ``(entries recovered, files deleted)`` of a rebuilt index (None: nothing)."""
    entries, dropped = recovered or (0, 0)
    text = f"rebuilt the index from the entry files: {entries:,} entries"
    return text + (f", {dropped:,} unusable or expired files deleted" if dropped else "")
