"""`check_folder`: whether a folder named on the command line (``--persistent-dir``) can be used, before
anything is loaded, made or opened."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_folder"]


def check_folder(path: str) -> str:
    """``path`` unchanged where it is a folder, or could be made as one: its nearest existing part is a folder,
    and where that is not ``path`` itself, one this process may write to. Nothing is created. (A folder that
    exists passes whether or not it is writable: the tier then decides, `PersistentStore.open`.)

    Raises:
        ValueError: that part is a file (``/tmp/afile/sub``), or ``path`` is missing and its nearest existing
            part not writable by this process (a read-only file system, or permissions; ``os.access``, so root
            passes permissions but not a read-only mount).
    """
    folder = Path(path).expanduser()
    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == folder else f"lies under {str(existing)!r}, which is"
        raise ValueError(f"{path!r} {what} not a folder")
    if existing != folder and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{path!r} cannot be made: its nearest existing part, {str(existing)!r}, is not writable by this process"
        )
    return path
