"""The read pass of a persistent-store lookup (`kvdiet.storage.persistent.PersistentStore.get_many`), outside
its lock: each looked-up entry's file read and checked against its index row, sorted into what the store does
next (serve, delete, count)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvdiet.storage.entry import EntryCodec
from kvdiet.storage.entry_files import ENTRY_FAULTS, read_file

__all__ = ["Dropped", "EntryReads", "read_entries"]

Dropped = tuple[bytes, float, bool]  # key, created (of the row read), corrupt (else: file missing)


@dataclass(slots=True)
class EntryReads:
    """What one read pass found.

    Attributes:
        out: per looked-up item, its payload or None (a miss).
        hits: keys served.
        expired: keys whose row was past its TTL (to delete if still expired).
        dropped: entries whose file is missing or corrupt (to delete if not rewritten since).
        unreadable: entries whose file could not be read on its own (another user's, a directory in its
            place), with the error: a miss each, dropped as a missing file is (their row, not their file).
        nread: bytes read for hits.
    """

    out: list[bytes | None]
    hits: list[bytes] = field(default_factory=list)
    expired: list[bytes] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    unreadable: list[tuple[bytes, OSError]] = field(default_factory=list)
    nread: int = 0


def read_entries(
    checked: Sequence[tuple[bytes, list[int]]],
    rows: Mapping[bytes, tuple[bytes, int, float, float]],
    *,
    now: float,
    tag: bytes,
    codec: EntryCodec,
    path_of: Callable[[bytes], str],
) -> EntryReads:
    """Read the entries of ``checked`` (key, token ids) found in ``rows`` (key → identity tag, size in bytes,
    created and expiry times in seconds) at time ``now``: an expired row is deleted whatever its identity (a read
    never revives an entry); another identity's is a plain miss; a missing, unreadable or corrupt file is dropped;
    a key an earlier item dropped or expired is a plain miss. Raises any OSError but a file's own (`ENTRY_FAULTS`,
    missing)."""
    found = EntryReads([None] * len(checked))
    gone: set[bytes] = set()  # keys an earlier item deleted
    for i, (key, ids) in enumerate(checked):
        if (row := rows.get(key)) is None or key in gone:
            continue
        identity, size, created, expires = row
        if now >= expires:
            gone.add(key)
            found.expired.append(key)
            continue
        if identity != tag:
            continue
        try:
            blob = read_file(path_of(key), size)
        except FileNotFoundError:
            gone.add(key)
            found.dropped.append((key, created, False))
            continue
        except ENTRY_FAULTS as exc:  # this entry's file alone: as if missing, and counted
            gone.add(key)
            found.dropped.append((key, created, False))
            found.unreadable.append((key, exc))
            continue
        verdict, found.out[i] = codec.unpack(blob, key, ids, created=created)
        if verdict == "corrupt":
            gone.add(key)
            found.dropped.append((key, created, True))
        elif verdict == "ok":
            found.hits.append(key)
            found.nread += len(blob)
    return found
