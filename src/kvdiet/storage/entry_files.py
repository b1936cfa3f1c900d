"""The persistent tier's entry files on disk: where a key's file lives, how one is written (a temp file the
caller renames into place), read and removed, and the sweep of temp files a crash left behind.

No fsync. The tier is a cache: an entry lost to a power failure is recomputed, never served wrong. After
a power loss a renamed file may be empty or torn and the index (WAL, ``synchronous=NORMAL``) may have
lost its last transactions: a torn or empty file fails the length or checksum check (a miss, deleted,
``corrupt_dropped``), a missing one is a plain miss. Measured on the dev machine (ext4, 512 files of
57 KB, temp file + rename): an fsync per file ~1 ms each (0.06 GB/s against 0.63 GB/s without); one
``os.sync()`` per batch 0.21 GB/s, and it flushes every filesystem of the machine; an fsync of the
directory would not make the files' data durable.

Not known here: what a file holds (`kvdiet.storage.entry`) and which files are live (the index,
`kvdiet.storage.persistent_index`).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Sequence
from contextlib import suppress

__all__ = [
    "ENTRY_FAULTS",
    "EntryFileError",
    "entry_path",
    "place",
    "read_file",
    "remove_stale_temp_files",
    "unlink",
    "write_temp",
]

TEMP_SUFFIX = ".tmp"
STALE_TEMP_S = 3600.0  # wall-clock age after which a temp file is taken for a crash's leftover


def entry_path(blocks: str, key: bytes) -> str:
    """The file of ``key`` under the ``blocks`` directory: ``<blocks>/<hex[:2]>/<hex>.kvb``."""
    name = key.hex()
    return f"{blocks}/{name[:2]}/{name}.kvb"


class EntryFileError(OSError):
    """Where one entry's file or folder goes, something the tier never made: not a regular file (a FIFO, whose open
    would wait for a writer forever; a device), a symlink loop, a dangling symlink where its folder goes."""


def _entry_error(exc: OSError, path: str) -> OSError:
    """``exc`` as an `EntryFileError` where it is a symlink loop (ELOOP has no OSError subclass of its own)."""
    return EntryFileError(exc.errno, exc.strerror, path) if exc.errno == errno.ELOOP else exc


def read_file(path: str, size: int) -> bytes:
    """The bytes of the file at ``path``, expected to be ``size`` long (then one read). Raises OSError
    (FileNotFoundError when it is missing; `EntryFileError` where it is no regular file, opened without waiting)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open returns at once
    except OSError as exc:
        raise _entry_error(exc, path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EntryFileError(errno.EINVAL, "not a regular file", path)
        data = os.read(fd, size + 1)
        if len(data) <= size:  # a short read of a regular file is its end
            return data
        parts = [data]
        while more := os.read(fd, 1 << 20):
            parts.append(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def write_temp(path: str, parts: Sequence[bytes | memoryview]) -> str:
    """Write ``parts`` to a uniquely named temp file beside ``path`` (creating its directory) and return
    the temp file's path; the caller renames it over ``path`` (readers see the old file or the new one;
    no fsync: module docstring). Raises OSError (temp removed)."""
    directory, name = os.path.split(path)
    tmp = f"{directory}/.{name.removesuffix('.kvb')}.{os.urandom(6).hex()}{TEMP_SUFFIX}"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)  # FileExistsError where a dangling symlink stands
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise _entry_error(exc, tmp) from None
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


ENTRY_FAULTS = (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError, EntryFileError)
"""The errors of one entry's file or folder, not of the tier: a directory where its file goes, a file or a dangling
symlink where its folder goes, another user's file or folder (entries are written mode 0600), an `EntryFileError`.
Its read is a miss, its write not stored."""


def place(tmp: str, path: str) -> OSError | None:
    """Rename the temp file ``tmp`` over ``path``: None, or an `ENTRY_FAULTS` error of that entry alone (a directory
    there; another user's file in a sticky directory), the temp file then removed. Raises any other OSError (the
    temp file left to the caller)."""
    try:
        os.replace(tmp, path)
    except ENTRY_FAULTS as exc:
        unlink(tmp)
        return exc
    return None


def unlink(path: str) -> None:
    """Remove a file; a missing one or a failure leaves an orphan the index never serves."""
    with suppress(OSError):
        os.unlink(path)


def remove_stale_temp_files(blocks: str) -> None:
    """Remove the temp files under ``blocks`` older than an hour of wall-clock time (file mtimes are
    wall-clock, whatever the store's clock is); errors are ignored."""
    cutoff = time.time() - STALE_TEMP_S
    with suppress(OSError), os.scandir(blocks) as subdirs:
        for sub in subdirs:
            with suppress(OSError), os.scandir(sub.path) as files:
                for f in files:
                    if f.name.endswith(TEMP_SUFFIX) and f.stat().st_mtime < cutoff:
                        unlink(f.path)
