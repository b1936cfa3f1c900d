"""`open_index`: the persistent tier's index opened for its store (`kvdiet.storage.persistent.PersistentStore`):
for writing (created where new; a damaged one moved aside and rebuilt from the entry files), or read-only where
asked, or where the folder or the index may not be written (a read-only volume, permissions). Every outcome but a
plain open is named in one warning.

A damaged index (``index.sqlite3`` that SQLite cannot read) is not the end of the tier: `open_index` moves it aside
(``index.sqlite3.damaged-<time>``, under a lock file so processes opening together do it once), starts a new
index and fills it from the entry files' own headers (`kvdiet.storage.index_recovery`), with one warning
naming both files. A new index in a directory that already holds entry files (the index deleted by hand) is
filled the same way. An index written by a newer kvdiet (a higher schema version) is left alone: the tier is
off, and the warning says so.

Read-only (``read_only``, ``--persistent-read-only``; taken as well, with one warning, where the folder exists but
this process may not write it, or its index will not open for writing, as on a read-only volume): the index opens
as an immutable file (`persistent_index.connect_read_only`: a snapshot no process writes meanwhile), reads serve
its entries (an expired, missing or corrupt one is a miss, left in place; a corrupt one counted once and warned
of) and change nothing, writes store nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from pathlib import Path

from kvdiet.storage.clock import Clock
from kvdiet.storage.index_recovery import damaged, damaged_hint, move_aside, recovered_text
from kvdiet.storage.persistent_index import connect, connect_read_only

INDEX_NAME = "index.sqlite3"
"""The persistent tier's index file, in its folder."""

__all__ = ["INDEX_NAME", "open_index"]

_log = logging.getLogger("kvdiet.storage.persistent")  # the store's own logger: its warnings, one voice


def open_index(
    directory: Path, blocks: Path, *, ttl_s: float, clock: Clock, read_only: bool
) -> tuple[sqlite3.Connection, bool] | None:
    """``(the index of directory, whether it is open read-only)``, or None where it cannot be opened (the tier is
    off; a warning names the index file and the error). For writing, the folder and ``blocks`` are made where
    missing (and removed again where the index then does not open) and a new index is filled from the entry
    files under ``blocks`` (entries ``ttl_s`` seconds from their creation, by ``clock``). ``read_only``, or a
    folder this process may not write (``os.access``: root passes but a read-only volume does not), or an index
    that will not open for writing there: opened read-only (`kvdiet.storage.persistent_index.connect_read_only`),
    nothing made or changed."""
    index = directory / INDEX_NAME
    if read_only:
        return _read_only(directory, blocks, None)
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        return _read_only(directory, blocks, "the folder is not writable by this process")
    made = _missing(blocks)  # the folders made below, to be removed again where the index does not open
    try:
        blocks.mkdir(parents=True, exist_ok=True)
        try:
            db, recovered = connect(index, blocks, ttl_s=ttl_s, clock=clock)
        except sqlite3.DatabaseError as exc:
            if not damaged(exc):
                raise
            moved = move_aside(index)
            db, recovered = connect(index, blocks, ttl_s=ttl_s, clock=clock)
            _log.warning(
                "persistent tier %s: the index %s was unreadable (%s)%s; %s",
                directory,
                index,
                exc,
                f", moved to {moved.name}" if moved else "",
                recovered_text(recovered),
            )
        else:
            if recovered is not None and (recovered[0] or recovered[1]):
                _log.warning("persistent tier %s: no index, %s", directory, recovered_text(recovered))
    except (OSError, sqlite3.Error) as exc:
        if index.is_file() and _read_only_error(exc):
            return _read_only(directory, blocks, f"the index will not open for writing ({exc})")
        if not blocks.is_dir():  # the entry folder's fault, not the index's
            _log.warning("persistent tier disabled: cannot make the entry folder %s: %s", blocks, exc)
        else:
            hint = damaged_hint(exc, index)
            _log.warning("persistent tier disabled: cannot open the index %s: %s%s", index, exc, hint)
        for folder in made:  # deepest first; one that is no longer empty stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        return None
    return db, False


def _missing(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(folder) and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def _read_only(directory: Path, blocks: Path, why: str | None) -> tuple[sqlite3.Connection, bool] | None:
    """The folder's index opened read-only, or None (a warning says why: a folder of entry files without an index
    says so, as a writable one would rebuild it); ``why`` the tier was not asked to be read-only, said in a
    warning."""
    index = directory / INDEX_NAME
    try:
        db = connect_read_only(index)
    except sqlite3.Error as exc:
        if not index.exists() and next(blocks.rglob("*.kvb"), None) is not None:
            _log.warning(
                "persistent tier disabled: %s holds entry files but no index (%s), and read-only it is not rebuilt; "
                "open the folder once where it may be written and kvdiet rebuilds the index from them",
                directory,
                index.name,
            )
        else:
            _log.warning("persistent tier disabled: cannot read the index %s: %s", index, exc)
        return None
    if why is not None:
        _log.warning("persistent tier %s read-only: %s; serving its entries, storing none", directory, why)
    return db, True


def _read_only_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the index may not be written (a read-only volume or file), not that it is broken."""
    return (isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)) or (
        isinstance(exc, sqlite3.OperationalError) and "readonly" in str(exc)
    )
