"""`check_folder`: whether a folder named on the command line (``--persistent-dir``) can be used, before
anything is loaded, made or opened."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvdiet.storage.index_open import INDEX_NAME

__all__ = ["check_folder"]


def check_folder(path: str, *, writes: bool = True) -> str:
    """``path`` unchanged where it is a folder the persistent tier can use, or could be made as one: its nearest
    existing part is a folder, and where that is not ``path`` itself, one this process may make folders in. A
    folder that exists passes where it holds a tier's index (``index.sqlite3``: the tier opens it read-only where
    it may not write there, `PersistentStore.open`), or where this process may make folders in it, or where
    ``writes`` is False (``--persistent-read-only``). Whether a folder can be made in is tried: a probe folder is
    made and removed at once (``os.access`` alone passes root on a pseudo file system such as ``/sys`` or
    ``/proc``, where nothing can be made; the tier was then turned off with a warning). Nothing else is made.

    Raises:
        ValueError: that part is a file (``/tmp/afile/sub``); ``path`` is missing and nothing can be made in its
            nearest existing part (a read-only file system, permissions, a pseudo file system); or ``path`` is a
            folder with no index that nothing can be made in, and ``writes`` is True.
    """
    folder = Path(path).expanduser()
    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == folder else f"lies under {str(existing)!r}, which is"
        raise ValueError(f"{path!r} {what} not a folder")
    if existing != folder and not _can_make_in(existing):
        raise ValueError(
            f"{path!r} cannot be made: its nearest existing part, {str(existing)!r}, is not writable by this process"
        )
    if existing == folder and writes and not (folder / INDEX_NAME).exists() and not _can_make_in(folder):
        raise ValueError(
            f"{path!r} is not writable by this process and holds no persistent tier to read ({INDEX_NAME})"
        )
    return path


def _can_make_in(folder: Path) -> bool:
    """Whether this process can make a folder in ``folder``: permissions first (``os.access``), then a probe
    folder made and removed at once (root passes the permissions, not a read-only mount or a pseudo file system)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvdiet-probe-", dir=folder))
    except OSError:
        return False
    return True
