"""Persistent tier: round trip, restart, TTL edges, corruption, identity, LRU, failures, concurrency."""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing
import os
import random
import threading
import zlib
from pathlib import Path

import pytest

from kvdiet.storage import entry_reads, persistent
from kvdiet.storage.clock import ManualClock
from kvdiet.storage.persistent import PersistentStore, StoreIdentity

BLOCK = 4
IDENTITY = StoreIdentity(fingerprint="ab" * 32, formats=("fp4_e2m1_e4m3x16", "mxfp4"), block_size=BLOCK)
LOGGER = "kvdiet.storage.persistent"


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def tokens_of(i: int, block: int = BLOCK) -> list[int]:
    return [1000 + i * block + j for j in range(block)]


def payload_of(i: int, size: int = 1000, writer: int = 0) -> bytes:
    return random.Random(i * 7919 + writer).randbytes(size)


def entry_path(directory: Path, key: bytes) -> Path:
    return directory / "blocks" / key.hex()[:2] / f"{key.hex()}.kvb"


def block_files(directory: Path) -> list[Path]:
    return sorted((directory / "blocks").rglob("*"))


def entry_bytes(directory: Path, keys: list[bytes]) -> int:
    return sum(entry_path(directory, k).stat().st_size for k in keys)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock):
    with PersistentStore(tmp_path / "ssd", IDENTITY, ttl_s=10.0, clock=clock) as s:
        yield s


def test_round_trip_counts_and_layout(store: PersistentStore) -> None:
    assert store.enabled
    assert store.put(key_of(0), tokens_of(0), payload_of(0))
    assert store.put(key_of(1), tokens_of(1), bytearray(payload_of(1, 10)))
    assert store.get(key_of(0), tokens_of(0)) == payload_of(0)
    assert store.get_many([key_of(1), key_of(2)], [tokens_of(1), tokens_of(2)]) == [payload_of(1, 10), None]
    size0 = entry_path(store.directory, key_of(0)).stat().st_size
    size1 = entry_path(store.directory, key_of(1)).stat().st_size
    assert size0 > 1000 and size1 > 10
    assert len(store) == 2 and store.nbytes == size0 + size1
    c = store.counters
    assert (c.entries_written, c.bytes_written) == (2, size0 + size1)
    assert (c.lookups, c.hits, c.bytes_read) == (3, 2, size0 + size1)
    assert (c.evictions, c.expirations, c.corrupt_dropped, c.write_errors) == (0, 0, 0, 0)
    assert (c.query_tokens, c.hit_tokens) == (0, 0)
    assert store.contains_prefix([key_of(0), key_of(1), key_of(2), key_of(0)]) == 2
    assert store.contains_prefix([key_of(2), key_of(0)]) == 0
    raw = entry_path(store.directory, key_of(0)).read_bytes()
    assert raw[:4] == b"KVDB" and raw.find(payload_of(0)) > 0  # raw bytes, not a pickle


def test_put_of_live_entry_keeps_it_and_its_ttl(store: PersistentStore, clock: ManualClock) -> None:
    assert store.put(key_of(0), tokens_of(0), payload_of(0))
    clock.set(5.0)
    assert store.put(key_of(0), tokens_of(0), payload_of(0))
    assert store.counters.entries_written == 1
    clock.set(10.0)
    assert store.get(key_of(0), tokens_of(0)) is None  # the second put did not extend the TTL


def test_restart_reads_entries_of_previous_instance(tmp_path: Path, clock: ManualClock) -> None:
    with PersistentStore(tmp_path, IDENTITY, clock=clock) as first:
        for i in range(3):
            assert first.put(key_of(i), tokens_of(i), payload_of(i))
    assert not first.enabled and first.get(key_of(0), tokens_of(0)) is None
    with PersistentStore(tmp_path, IDENTITY, clock=clock) as second:
        assert len(second) == 3
        assert second.get_many([key_of(i) for i in range(3)], [tokens_of(i) for i in range(3)]) == [
            payload_of(i) for i in range(3)
        ]
        assert second.counters.hits == 3 and second.counters.entries_written == 0


def test_a_file_where_the_entry_folder_goes_is_named_as_that(
    tmp_path: Path, clock: ManualClock, caplog
) -> None:
    """``blocks`` a plain file: the tier is off with a warning naming the entry folder (it named the index, with
    the entry folder's error), and nothing is made."""
    given = tmp_path / "given"
    given.mkdir()
    (given / "blocks").write_bytes(b"not a folder")
    with (
        caplog.at_level(logging.WARNING, logger="kvdiet"),
        PersistentStore(given, IDENTITY, clock=clock) as s,
    ):
        assert not s.enabled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot make the entry folder" in warnings[0] and "index" not in warnings[0]
    assert [p.name for p in given.iterdir()] == ["blocks"]


def test_an_index_that_does_not_open_leaves_no_folder_made(
    tmp_path: Path, clock: ManualClock, caplog, monkeypatch
) -> None:
    """The tier off with its warning changed the folder all the same: ``blocks/`` (and the missing folders above
    it) was made before the index failed to open."""
    import sqlite3

    from kvdiet.storage import index_open

    given = tmp_path / "given"
    (given / "index.sqlite3").mkdir(parents=True)  # a folder where the index file goes
    with (
        caplog.at_level(logging.WARNING, logger="kvdiet"),
        PersistentStore(given, IDENTITY, clock=clock) as s,
    ):
        assert not s.enabled
    assert [p.name for p in given.iterdir()] == ["index.sqlite3"]

    def fails(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(index_open, "connect", fails)
    with (
        caplog.at_level(logging.WARNING, logger="kvdiet"),
        PersistentStore(tmp_path / "new" / "kv", IDENTITY, clock=clock) as s,
    ):
        assert not s.enabled
    assert sum("cannot open the index" in r.getMessage() for r in caplog.records) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given"]  # new/, new/kv/ and new/kv/blocks/ removed


def test_ttl_edges_single_and_batch_agree(tmp_path: Path, clock: ManualClock) -> None:
    store = PersistentStore(tmp_path, IDENTITY, ttl_s=10.0, clock=clock)
    store.open()
    a, b = (key_of(0), tokens_of(0)), (key_of(1), tokens_of(1))
    assert store.put(*a, payload_of(0)) and store.put(*b, payload_of(1))
    for t in (5.0, 9.9):
        clock.set(t)
        assert store.get(*a) == payload_of(0)
        assert store.get_many([b[0]], [b[1]]) == [payload_of(1)]
        assert store.contains_prefix([a[0], b[0]]) == 2
    clock.set(10.0)  # exclusive deadline; the reads at 5 and 9.9 did not extend it
    assert store.contains_prefix([a[0], b[0]]) == 0
    assert store.get(*a) is None
    assert store.get_many([b[0]], [b[1]]) == [None]
    assert store.counters.expirations == 2 and len(store) == 0 and store.nbytes == 0
    assert not entry_path(tmp_path, a[0]).exists() and not entry_path(tmp_path, b[0]).exists()
    for t in (11.0, 12.0):
        clock.set(t)
        assert store.get(*a) is None and store.get_many([a[0], b[0]], [a[1], b[1]]) == [None, None]
    assert store.counters.hits == 4 and store.counters.expirations == 2
    store.close()
    with PersistentStore(tmp_path, IDENTITY, ttl_s=10.0, clock=clock) as again:
        assert again.get(*a) is None  # not revived by a restart either
        assert again.put(*a, payload_of(0))  # a new write is a new entry with a new deadline
        clock.set(21.9)
        assert again.get(*a) == payload_of(0)
        clock.set(22.0)
        assert again.get_many([a[0]], [a[1]]) == [None]


def test_expired_entry_is_missed_even_unread_until_then_and_sweep_removes_it(
    tmp_path: Path, clock: ManualClock
) -> None:
    with PersistentStore(tmp_path, IDENTITY, ttl_s=10.0, clock=clock) as store:
        for i in range(3):
            clock.set(float(i))
            assert store.put(key_of(i), tokens_of(i), payload_of(i))
        clock.set(11.0)  # entries 0 and 1 expired (deadlines 10, 11), entry 2 lives until 12
        assert store.get_many([key_of(1), key_of(2)], [tokens_of(1), tokens_of(2)]) == [None, payload_of(2)]
        assert store.sweep() == 1  # entry 0; entry 1 was already deleted by the read
        assert store.counters.expirations == 2
        assert len(store) == 1 and [p.name for p in block_files(tmp_path) if p.is_file()] == [
            f"{key_of(2).hex()}.kvb"
        ]
        clock.set(12.0)
        assert store.sweep() == 1 and len(store) == 0 and store.sweep() == 0


def _truncate(data: bytearray) -> bytearray:
    return data[: len(data) // 2]


def _flip_payload_bit(data: bytearray) -> bytearray:
    data[len(data) - 100] ^= 0x10
    return data


def _flip_header_bit(data: bytearray) -> bytearray:
    data[data.index(b'"block_size":') + len('"block_size":')] ^= 0x01  # 4 -> 5 in the JSON header
    return data


def _flip_magic(data: bytearray) -> bytearray:
    data[0] ^= 0x01
    return data


def _bump_version(data: bytearray) -> bytearray:
    data[4] += 1
    return data


def _drop_checksum_byte(data: bytearray) -> bytearray:
    return data[:-1]


@pytest.mark.parametrize(
    "damage",
    [_truncate, _flip_payload_bit, _flip_header_bit, _flip_magic, _bump_version, _drop_checksum_byte],
)
def test_damaged_file_is_dropped_and_counted(store: PersistentStore, damage) -> None:
    key, tokens = key_of(0), tokens_of(0)
    assert store.put(key, tokens, payload_of(0)) and store.put(key_of(1), tokens_of(1), payload_of(1))
    path = entry_path(store.directory, key)
    path.write_bytes(damage(bytearray(path.read_bytes())))
    assert store.get(key, tokens) is None
    assert store.counters.corrupt_dropped == 1 and store.counters.hits == 0
    assert not path.exists() and len(store) == 1
    assert store.get(key, tokens) is None and store.counters.corrupt_dropped == 1  # now a plain miss
    assert store.get(key_of(1), tokens_of(1)) == payload_of(1)  # the neighbour is untouched
    assert store.put(key, tokens, payload_of(0)) and store.get(key, tokens) == payload_of(0)


def test_damage_found_by_batch_lookup(store: PersistentStore) -> None:
    keys, tokens = [key_of(i) for i in range(3)], [tokens_of(i) for i in range(3)]
    for i in range(3):
        assert store.put(keys[i], tokens[i], payload_of(i))
    entry_path(store.directory, keys[1]).write_bytes(b"")
    assert store.get_many(keys, tokens) == [payload_of(0), None, payload_of(2)]
    assert store.counters.corrupt_dropped == 1 and len(store) == 2


def test_wrong_token_ids_are_a_miss_and_drop(store: PersistentStore) -> None:
    assert store.put(key_of(0), tokens_of(0), payload_of(0))
    wrong = tokens_of(0)
    wrong[-1] += 1
    assert store.get(key_of(0), wrong) is None
    assert store.counters.corrupt_dropped == 1 and len(store) == 0


def test_missing_file_is_a_plain_miss(store: PersistentStore) -> None:
    assert store.put(key_of(0), tokens_of(0), payload_of(0))
    entry_path(store.directory, key_of(0)).unlink()
    assert store.get(key_of(0), tokens_of(0)) is None
    assert store.counters.corrupt_dropped == 0 and len(store) == 0


@pytest.mark.parametrize("fault", ["directory", "permission"])
def test_an_unreadable_entry_is_a_miss_and_a_counter_and_the_tier_stays_on(
    store: PersistentStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """One entry file that cannot be read (a directory in its place; another user's file, mode 0600) is a miss
    counted in ``read_errors`` and warned of, its row dropped as a missing file's and the file left alone; the
    entries beside it are served and the tier stays on (one bad file turned the whole tier off for the process).
    A later write of it replaces the file where it can (healed), else is one entry not stored."""
    assert store.put_many(_items([0, 1, 2])) == 3
    bad = entry_path(store.directory, key_of(1))
    if fault == "directory":
        bad.unlink()
        bad.mkdir()
    else:
        real = entry_reads.read_file

        def refuse(path: str, size: int) -> bytes:
            if path == str(bad):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real(path, size)

        monkeypatch.setattr(entry_reads, "read_file", refuse)
    keys, tokens = [key_of(i) for i in (0, 1, 2, 1)], [tokens_of(i) for i in (0, 1, 2, 1)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get_many(keys, tokens) == [payload_of(0), None, payload_of(2), None]
        assert store.get(key_of(1), tokens_of(1)) is None  # its row gone: a plain miss
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and key_of(1).hex() in warnings[0] and "cannot be read" in warnings[0]
    assert store.enabled and store.counters.read_errors == 1 and store.counters.corrupt_dropped == 0
    assert store.counters.hits == 2 and len(store) == 2 and bad.exists()
    monkeypatch.undo()
    if fault == "directory":
        assert not store.put(*_items([1])[0]) and store.counters.write_errors == 1 and bad.is_dir()
    else:
        assert store.put(*_items([1])[0]) and store.get(key_of(1), tokens_of(1)) == payload_of(1)
    assert (
        store.enabled and store.put(*_items([3])[0]) and store.get(key_of(3), tokens_of(3)) == payload_of(3)
    )


def test_an_entry_whose_file_or_folder_cannot_be_used_is_not_stored_and_the_rest_is(
    store: PersistentStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory where an entry's file goes (the rename fails) or a file where its folder goes (the temp file
    cannot be made): that entry is not stored (a ``write_errors`` each, warned of), the rest of its batch is, its
    count leaves out every item of those keys (a key given twice counted twice), and the tier stays on."""
    entry_path(store.directory, key_of(5)).mkdir(parents=True)
    shard = entry_path(store.directory, key_of(7)).parent
    assert not shard.exists()
    shard.write_bytes(b"a file where a folder goes")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.put_many(_items([4, 5, 5, 6, 7])) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 2 and all("cannot be written" in w for w in warnings)
    assert store.enabled and store.counters.write_errors == 2 and store.counters.entries_written == 2
    assert len(store) == 2 and store.get(key_of(5), tokens_of(5)) is None and store.counters.read_errors == 0
    assert [store.get(key_of(i), tokens_of(i)) for i in (4, 6)] == [payload_of(4), payload_of(6)]
    assert not [p for p in block_files(store.directory) if p.name.endswith(".tmp")]  # no temp file left
    assert store.put_many(_items([7])) == 0 and store.counters.write_errors == 3  # alone in its batch too


def test_a_fifo_or_a_symlink_loop_in_an_entrys_place_is_a_miss_at_once(store: PersistentStore) -> None:
    """A FIFO where an entry's file goes (its open waited for a writer forever: the engine hung) and a symlink
    loop where its folder goes (ELOOP turned the tier off) are misses counted in ``read_errors``; a dangling
    symlink where a folder goes is one entry not stored (FileExistsError turned the tier off)."""
    assert store.put_many(_items([0, 1, 2])) == 3
    fifo = entry_path(store.directory, key_of(1))
    fifo.unlink()
    os.mkfifo(fifo)
    shard = entry_path(store.directory, key_of(2)).parent
    for other in shard.iterdir():
        other.unlink()
    shard.rmdir()
    shard.symlink_to(shard.name)  # blocks/xx -> xx: a loop
    result: list = []
    reader = threading.Thread(
        target=lambda: result.append(
            store.get_many([key_of(i) for i in range(3)], [tokens_of(i) for i in range(3)])
        )
    )
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive() and result == [[payload_of(0), None, None]]
    assert store.enabled and store.counters.read_errors == 2 and len(store) == 1
    dangling = entry_path(store.directory, key_of(9)).parent
    assert not dangling.exists()  # key 9's folder: none of the keys above
    dangling.symlink_to("/nonexistent/kvdiet-test")
    assert store.put_many(_items([9, 3])) == 1 and store.counters.write_errors == 1 and store.enabled
    assert store.get(key_of(0), tokens_of(0)) == payload_of(0)


def test_entry_warnings_stop_after_twenty(store: PersistentStore, caplog: pytest.LogCaptureFixture) -> None:
    """A folder of entries that cannot be written warns of the first 20 and once more, and counts them all."""
    for i in range(30):
        entry_path(store.directory, key_of(i)).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.put_many(_items(list(range(30)))) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 21 and "only counted from here" in warnings[-1]
    assert store.enabled and store.counters.write_errors == 30


@pytest.mark.parametrize(
    "other",
    [
        StoreIdentity(fingerprint="cd" * 32, formats=IDENTITY.formats, block_size=BLOCK),
        StoreIdentity(fingerprint=IDENTITY.fingerprint, formats=("fp8_e4m3",), block_size=BLOCK),
        StoreIdentity(fingerprint=IDENTITY.fingerprint, formats=IDENTITY.formats, block_size=2 * BLOCK),
    ],
    ids=["fingerprint", "formats", "block_size"],
)
def test_other_identity_misses_without_deleting(
    tmp_path: Path, clock: ManualClock, other: StoreIdentity
) -> None:
    with (
        PersistentStore(tmp_path, IDENTITY, clock=clock) as mine,
        PersistentStore(tmp_path, other, clock=clock) as theirs,
    ):
        assert mine.put(key_of(0), tokens_of(0), payload_of(0))
        their_tokens = tokens_of(0, other.block_size)
        assert theirs.get(key_of(0), their_tokens) is None
        assert theirs.get_many([key_of(0)], [their_tokens]) == [None]
        assert theirs.contains_prefix([key_of(0)]) == 0
        assert (theirs.counters.lookups, theirs.counters.hits, theirs.counters.corrupt_dropped) == (2, 0, 0)
        assert mine.get(key_of(0), tokens_of(0)) == payload_of(0)  # still there for its owner


def test_file_of_other_identity_behind_own_row_is_not_served_nor_deleted(
    tmp_path: Path, clock: ManualClock
) -> None:
    # Two models racing on one key can leave one's row next to the other's file.
    other = StoreIdentity(fingerprint="cd" * 32, formats=IDENTITY.formats, block_size=BLOCK)
    with (
        PersistentStore(tmp_path, IDENTITY, clock=clock) as mine,
        PersistentStore(tmp_path, other, clock=clock) as theirs,
    ):
        path = entry_path(tmp_path, key_of(0))
        assert mine.put(key_of(0), tokens_of(0), payload_of(0))
        mine_bytes = path.read_bytes()
        assert theirs.put(key_of(0), tokens_of(0), payload_of(1))  # another identity: rewritten
        assert theirs.get(key_of(0), tokens_of(0)) == payload_of(1)
        assert mine.get(key_of(0), tokens_of(0)) is None
        path.write_bytes(mine_bytes)  # their row, my file
        assert theirs.get(key_of(0), tokens_of(0)) is None
        assert theirs.counters.corrupt_dropped == 0 and path.read_bytes() == mine_bytes and len(theirs) == 1


def test_capacity_evicts_least_recently_read(tmp_path: Path, clock: ManualClock) -> None:
    with PersistentStore(tmp_path, IDENTITY, clock=clock) as store:
        assert store.put(key_of(0), tokens_of(0), payload_of(0))
        size = store.nbytes  # the others differ by a byte or two (the creation time in the header)
        store.capacity_bytes = 3 * size + size // 2
        for i in (1, 2):
            clock.set(float(i))
            assert store.put(key_of(i), tokens_of(i), payload_of(i))
        clock.set(3.0)
        assert store.get(key_of(0), tokens_of(0)) == payload_of(0)  # oldest write, most recent read
        clock.set(4.0)
        assert store.put(key_of(3), tokens_of(3), payload_of(3))
        assert store.counters.evictions == 1 and len(store) == 3
        assert store.nbytes == entry_bytes(tmp_path, [key_of(0), key_of(2), key_of(3)])
        assert store.get(key_of(1), tokens_of(1)) is None and not entry_path(tmp_path, key_of(1)).exists()
        assert store.contains_prefix([key_of(0)]) == 1 and store.contains_prefix([key_of(2)]) == 1
        clock.set(5.0)
        assert store.put(key_of(4), tokens_of(4), payload_of(4))  # now entry 2 is the least recent
        assert store.counters.evictions == 2 and store.nbytes <= store.capacity_bytes
        got = [store.get(key_of(i), tokens_of(i)) for i in range(5)]
        assert got == [payload_of(0), None, None, payload_of(3), payload_of(4)]


def test_capacity_drops_expired_entries_before_live_ones(tmp_path: Path, clock: ManualClock) -> None:
    with PersistentStore(tmp_path, IDENTITY, ttl_s=10.0, clock=clock) as store:
        assert store.put(key_of(0), tokens_of(0), payload_of(0))
        size = store.nbytes
        store.capacity_bytes = 2 * size + size // 2
        clock.set(5.0)
        assert store.put(key_of(1), tokens_of(1), payload_of(1))
        clock.set(6.0)
        assert store.get(key_of(1), tokens_of(1)) == payload_of(1)
        clock.set(11.0)  # entry 0 expired (never read since its write at 0), entry 1 alive
        assert store.put(key_of(2), tokens_of(2), payload_of(2))
        assert (store.counters.expirations, store.counters.evictions) == (1, 0)
        assert store.get(key_of(1), tokens_of(1)) == payload_of(1) and len(store) == 2


def test_leftover_temp_file_is_never_served(store: PersistentStore) -> None:
    key, tokens = key_of(0), tokens_of(0)
    assert store.put(key, tokens, payload_of(0))
    final = entry_path(store.directory, key)
    good = final.read_bytes()
    # A crash after writing half of a newer copy: the temp file is beside the entry, never renamed.
    crashed = final.parent / f".{key.hex()}.crash123.tmp"
    crashed.write_bytes(good[: len(good) // 2])
    orphan_key = key_of(1)  # a crash before the first entry of this key was renamed into place
    orphan = entry_path(store.directory, orphan_key).parent / f".{orphan_key.hex()}.crash456.tmp"
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(good)
    assert store.get(key, tokens) == payload_of(0)
    assert store.get(orphan_key, tokens_of(1)) is None
    assert store.contains_prefix([key, orphan_key]) == 1
    with PersistentStore(store.directory, IDENTITY, clock=store.clock) as restarted:
        assert restarted.get(key, tokens) == payload_of(0)
        assert restarted.counters.corrupt_dropped == 0
    old = os.stat(crashed).st_mtime - 2 * 3600
    os.utime(crashed, (old, old))
    assert store.sweep() == 0
    assert not crashed.exists() and orphan.exists()  # only the stale temp file is cleaned up
    assert store.get(key, tokens) == payload_of(0)


def test_unwritable_directory_disables_with_one_warning(
    tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    store = PersistentStore(blocker / "ssd", IDENTITY, clock=clock)
    assert not store.enabled  # nothing before open
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store.open()
        assert not store.enabled
        assert store.put(key_of(0), tokens_of(0), payload_of(0)) is False
        assert store.get(key_of(0), tokens_of(0)) is None
        assert store.get_many([key_of(0)], [tokens_of(0)]) == [None]
        assert store.contains_prefix([key_of(0)]) == 0
        assert store.sweep() == 0 and len(store) == 0 and store.nbytes == 0
        store.close()
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.WARNING]
    assert store.counters.entries_written == 0 and store.counters.lookups == 0


def test_disk_full_disables_with_one_warning(
    store: PersistentStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert store.put(key_of(0), tokens_of(0), payload_of(0))

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persistent.os, "write", full)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.put(key_of(1), tokens_of(1), payload_of(1)) is False
        assert not store.enabled
        assert store.put(key_of(2), tokens_of(2), payload_of(2)) is False
        assert store.get(key_of(0), tokens_of(0)) is None
    monkeypatch.undo()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and "No space left" in records[0].getMessage()
    assert store.counters.write_errors == 1 and store.counters.entries_written == 1
    assert [p.name for p in block_files(store.directory) if p.is_file()] == [f"{key_of(0).hex()}.kvb"]
    with PersistentStore(store.directory, IDENTITY, clock=store.clock) as after:
        assert after.get(key_of(0), tokens_of(0)) == payload_of(0) and len(after) == 1


def test_bad_arguments_raise_before_any_change(store: PersistentStore) -> None:
    good = (key_of(0), tokens_of(0), payload_of(0))
    bad_puts = [
        (key_of(0)[:31], good[1], good[2]),
        (key_of(0) + b"x", good[1], good[2]),
        (key_of(0).hex(), good[1], good[2]),
        (good[0], tokens_of(0)[:-1], good[2]),
        (good[0], [*tokens_of(0), 1], good[2]),
        (good[0], [0.5, 1, 2, 3], good[2]),
        (good[0], [-1, 1, 2, 3], good[2]),
        (good[0], good[1], "text"),
        (good[0], good[1], None),
        (good[0], good[1], [1, 2, 3]),
    ]
    for args in bad_puts:
        with pytest.raises(ValueError):
            store.put(*args)
    with pytest.raises(ValueError):
        store.get(key_of(0)[:16], good[1])
    with pytest.raises(ValueError):
        store.get_many([key_of(0), key_of(1)], [good[1]])
    with pytest.raises(ValueError):
        store.get_many([key_of(0), b"short"], [good[1], good[1]])
    with pytest.raises(ValueError):
        store.contains_prefix([b"short"])
    with pytest.raises(ValueError):
        PersistentStore(store.directory, IDENTITY, ttl_s=0.0)
    with pytest.raises(ValueError):
        StoreIdentity(fingerprint="", formats=(), block_size=BLOCK)
    with pytest.raises(ValueError):
        StoreIdentity(fingerprint="ab", formats=["mxfp4"], block_size=BLOCK)  # type: ignore[arg-type]
    assert store.counters.as_dict() == dict.fromkeys(store.counters.as_dict(), 0)
    assert len(store) == 0 and store.nbytes == 0 and block_files(store.directory) == []
    assert store.put(*good) and store.get(good[0], good[1]) == good[2]


def test_threads_put_get_sweep_never_see_wrong_bytes(tmp_path: Path, clock: ManualClock) -> None:
    keys = 24
    with PersistentStore(tmp_path, IDENTITY, ttl_s=3.0, capacity_bytes=12 * 1300, clock=clock) as store:
        wrong: list[tuple[int, bytes]] = []
        hits = [0] * 6
        stop = threading.Event()

        def worker(w: int) -> None:
            rng = random.Random(w)
            for _ in range(300):
                i, op = rng.randrange(keys), rng.random()
                if op < 0.4:
                    store.put(key_of(i), tokens_of(i), payload_of(i))
                    continue
                if op < 0.6:
                    got = store.get_many([key_of(i)], [tokens_of(i)])[0]
                elif op < 0.95:
                    got = store.get(key_of(i), tokens_of(i))
                else:
                    store.sweep()
                    continue
                if got is not None:
                    hits[w] += 1
                    if got != payload_of(i):
                        wrong.append((i, got))

        def ticker() -> None:
            while not stop.is_set():
                clock.advance(0.05)
                stop.wait(0.002)

        tick = threading.Thread(target=ticker)
        tick.start()
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        tick.join()
        assert store.enabled and wrong == []
        assert sum(hits) > 0 and store.counters.hits == sum(hits)
        assert store.nbytes <= 12 * 1300 and store.counters.write_errors == 0
        assert store.counters.evictions + store.counters.expirations > 0


def _writer_process(directory: str, writer: int, keys: int, barrier, results) -> None:
    """Spawned: write shared keys and own keys, wait for the other writer, then read everything."""
    failures: list[str] = []
    with PersistentStore(directory, IDENTITY) as store:
        barrier.wait(timeout=60)
        for i in range(keys):
            shared = keys - 1 - i if writer else i  # opposite orders, so both write some keys at once
            if not store.put(key_of(shared), tokens_of(shared), payload_of(shared, 200, writer)):
                failures.append(f"put shared {shared}")
            own = 1000 * (writer + 1) + i
            if not store.put(key_of(own), tokens_of(own), payload_of(own, 200)):
                failures.append(f"put own {own}")
        barrier.wait(timeout=60)
        for i in range(keys):
            got = store.get(key_of(i), tokens_of(i))
            if got not in (payload_of(i, 200, 0), payload_of(i, 200, 1)):
                failures.append(f"shared {i}: {got!r:.40}")
            theirs = 1000 * (2 - writer) + i
            if store.get(key_of(theirs), tokens_of(theirs)) != payload_of(theirs, 200):
                failures.append(f"theirs {theirs}")
        results.put((writer, failures, store.counters.hits, store.enabled))


def test_two_processes_write_same_keys(tmp_path: Path) -> None:
    keys = 60
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_writer_process, args=(str(tmp_path), w, keys, barrier, results)) for w in (0, 1)
    ]
    for p in procs:
        p.start()
    reports = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert reports == [(0, [], 2 * keys, True), (1, [], 2 * keys, True)]
    with PersistentStore(tmp_path, IDENTITY) as store:
        assert len(store) == 3 * keys
        for i in range(keys):
            assert store.get(key_of(i), tokens_of(i)) in (payload_of(i, 200, 0), payload_of(i, 200, 1))
        assert store.counters.corrupt_dropped == 0
    assert not [p for p in block_files(tmp_path) if p.name.endswith(".tmp")]


def _items(ids: list[int]) -> list[tuple[bytes, list[int], bytes]]:
    return [(key_of(i), tokens_of(i), payload_of(i)) for i in ids]


def _count_transactions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = persistent.transaction

    def counting(db):
        calls.append(1)
        return real(db)

    monkeypatch.setattr(persistent, "transaction", counting)
    return calls


def test_put_many_stores_a_batch_in_one_transaction(
    store: PersistentStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.put(*_items([0])[0])
    transactions = _count_transactions(monkeypatch)
    batch = _items([1, 2, 0, 3, 1])  # 0 is live already, 1 repeats
    assert store.put_many(batch) == 5
    assert len(transactions) == 1 and len(store) == 4 and store.counters.entries_written == 4
    assert store.nbytes == entry_bytes(store.directory, [key_of(i) for i in range(4)])
    ids = [0, 1, 2, 3]
    assert store.get_many([key_of(i) for i in ids], [tokens_of(i) for i in ids]) == [
        payload_of(i) for i in ids
    ]
    assert store.put_many([]) == 0 and store.put_many(_items([2, 3])) == 2  # live: nothing written
    assert len(transactions) == 1 and store.counters.entries_written == 4  # read times still pending


@pytest.mark.parametrize(
    "bad",
    [
        (key_of(9)[:31], tokens_of(9), payload_of(9)),
        (key_of(9), tokens_of(9)[:-1], payload_of(9)),
        (key_of(9), [-1, 1, 2, 3], payload_of(9)),
        (key_of(9), tokens_of(9), "text"),
        (key_of(9), tokens_of(9)),
        None,
    ],
    ids=["short-key", "few-tokens", "negative-token", "str-payload", "pair", "none"],
)
def test_put_many_with_one_bad_item_raises_and_stores_nothing(store: PersistentStore, bad) -> None:
    batch: list = _items([0, 1])
    batch.insert(1, bad)
    with pytest.raises(ValueError):
        store.put_many(batch)
    assert len(store) == 0 and block_files(store.directory) == []
    assert store.counters.as_dict() == dict.fromkeys(store.counters.as_dict(), 0)
    assert store.enabled and store.put_many(_items([0, 1])) == 2


def test_put_many_evicts_least_recently_read_once(tmp_path: Path, clock: ManualClock) -> None:
    with PersistentStore(tmp_path, IDENTITY, clock=clock) as store:
        assert store.put(*_items([0])[0])
        size = store.nbytes
        store.capacity_bytes = 4 * size + size // 2
        for i in (1, 2):
            clock.set(float(i))
            assert store.put(*_items([i])[0])
        clock.set(3.0)
        assert store.get(key_of(0), tokens_of(0)) == payload_of(0)  # now entry 1 is the least recent
        clock.set(4.0)
        assert store.put_many(_items([3, 4, 5])) == 3  # 6 entries for room for 4: entries 1 and 2 go
        assert store.counters.evictions == 2 and len(store) == 4 and store.nbytes <= store.capacity_bytes
        assert not entry_path(tmp_path, key_of(1)).exists() and not entry_path(tmp_path, key_of(2)).exists()
        ids = [0, 3, 4, 5]
        assert store.contains_prefix([key_of(i) for i in ids]) == 4
        clock.set(5.0)
        batch = _items([6, 7, 8, 9, 10, 11])  # more than fits: all older entries go, then the lowest keys
        assert store.put_many(batch) == 6
        assert store.counters.evictions == 2 + 6 and len(store) == 4 and store.nbytes <= store.capacity_bytes
        kept = sorted(key_of(i) for i in range(6, 12))[2:]
        assert sorted(p.name for p in block_files(tmp_path) if p.is_file()) == sorted(
            f"{k.hex()}.kvb" for k in kept
        )


def test_put_many_failure_mid_batch_leaves_no_files(
    store: PersistentStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert store.put(*_items([0])[0])
    real_write, calls = os.write, []

    def full_on_third_file(fd: int, data) -> int:
        calls.append(fd)
        if len(calls) > 6:  # three parts per file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(persistent.os, "write", full_on_third_file)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.put_many(_items([1, 2, 3, 4])) == 0
    monkeypatch.undo()
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.WARNING]
    assert not store.enabled and store.counters.write_errors == 1 and store.counters.entries_written == 1
    assert [p.name for p in block_files(store.directory) if p.is_file()] == [f"{key_of(0).hex()}.kvb"]
    with PersistentStore(store.directory, IDENTITY, clock=store.clock) as after:
        assert len(after) == 1 and after.get(key_of(0), tokens_of(0)) == payload_of(0)


def _mixed_store(directory: Path) -> PersistentStore:
    """At t=12: entries 0-2 live, 3 expired (at 10), 4 damaged, 5 file missing, 6 another identity's
    row, 7 own row with another identity's file; key 9 never stored."""
    other = StoreIdentity(fingerprint="cd" * 32, formats=IDENTITY.formats, block_size=BLOCK)
    clock = ManualClock()
    store = PersistentStore(directory, IDENTITY, ttl_s=10.0, clock=clock)
    store.open()
    with PersistentStore(directory, other, ttl_s=10.0, clock=clock) as theirs:
        assert store.put(*_items([3])[0])
        clock.set(5.0)
        assert store.put_many(_items([0, 1, 2, 4, 5, 7])) == 6
        assert theirs.put(*_items([6])[0])
    path = entry_path(directory, key_of(4))
    path.write_bytes(_flip_payload_bit(bytearray(path.read_bytes())))
    entry_path(directory, key_of(5)).unlink()
    path = entry_path(directory, key_of(7))
    body = path.read_bytes()[:-4].replace(b"ab" * 32, b"cd" * 32)  # the same entry, of the other model
    path.write_bytes(body + zlib.crc32(body).to_bytes(4, "little"))
    clock.set(12.0)
    return store


def test_get_many_mixed_batch_equals_get_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [0, 9, 3, 4, 6, 7, 5, 1, 0, 4, 3, 2]  # hit, miss, expired, corrupt, foreign x2, missing, repeats
    wrong = tokens_of(1)
    wrong[0] += 1
    keys = [key_of(i) for i in ids] + [key_of(1), key_of(1)]
    tokens = [tokens_of(i) for i in ids] + [wrong, tokens_of(1)]  # entry 1 read, then dropped: its tokens
    one, many = _mixed_store(tmp_path / "one"), _mixed_store(tmp_path / "many")
    singles = [one.get(k, t) for k, t in zip(keys, tokens, strict=True)]
    transactions = _count_transactions(monkeypatch)
    statements: list[str] = []
    many._db.set_trace_callback(statements.append)
    assert many.get_many(keys, tokens) == singles
    hits = {0: payload_of(0), 7: payload_of(1), 8: payload_of(0), 11: payload_of(2)}
    assert singles == [hits.get(i) for i in range(len(keys))]
    assert sum(s.startswith("SELECT") for s in statements) == 1 and len(transactions) == 1
    assert many.counters == one.counters
    c = one.counters
    assert (c.lookups, c.hits, c.expirations, c.corrupt_dropped) == (14, 4, 1, 2)
    assert len(many) == len(one) == 4  # 0, 2, 6 (the other identity's) and 7 (another model's file)
    for store in (one, many):
        files = sorted(p.name for p in block_files(store.directory) if p.is_file())
        assert files == sorted(f"{key_of(i).hex()}.kvb" for i in (0, 2, 6, 7))
    for store in (one, many):
        store.close()


def test_read_times_written_at_close_steer_the_next_eviction(tmp_path: Path, clock: ManualClock) -> None:
    with PersistentStore(tmp_path, IDENTITY, clock=clock) as store:
        assert store.put_many(_items([0, 1])) == 2
        size = store.nbytes // 2
        clock.set(1.0)
        assert store.get_many([key_of(0)], [tokens_of(0)]) == [payload_of(0)]
    with PersistentStore(tmp_path, IDENTITY, capacity_bytes=2 * size + size // 2, clock=clock) as again:
        clock.set(2.0)
        assert again.put(*_items([2])[0])
        assert again.counters.evictions == 1 and again.contains_prefix([key_of(0), key_of(2)]) == 2


def _fill(directory: Path, clock: ManualClock, n: int, *, ttl_s: float = 100.0) -> list[bytes]:
    with PersistentStore(directory, IDENTITY, ttl_s=ttl_s, clock=clock) as s:
        assert s.put_many([(key_of(i), tokens_of(i), payload_of(i)) for i in range(n)]) == n
    return [key_of(i) for i in range(n)]


def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_entry_files(
    tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18 point 7: a corrupt ``index.sqlite3`` once disabled the tier on every run with no hint."""
    directory = tmp_path / "ssd"
    keys = _fill(directory, clock, 3)
    other = StoreIdentity(fingerprint="cd" * 32, formats=IDENTITY.formats, block_size=BLOCK)
    with PersistentStore(directory, other, ttl_s=100.0, clock=clock) as theirs:
        assert theirs.put(key_of(9), tokens_of(9), payload_of(9))
    bad = entry_path(directory, key_of(7))  # a file whose header does not parse: deleted
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"KVDB\x01\x00garbage")
    index = directory / "index.sqlite3"
    index.write_bytes(b"this is not a database" * 100)
    clock.advance(10.0)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        PersistentStore(directory, IDENTITY, clock=clock) as s,
    ):
        assert s.enabled and len(s) == 4  # three of mine, one of theirs
        assert s.get_many(keys, [tokens_of(i) for i in range(3)]) == [payload_of(i) for i in range(3)]
        assert s.get(key_of(9), tokens_of(9)) is None  # another identity's entry: indexed, never served
        assert s.contains_prefix(keys) == 3
    moved = [p.name for p in directory.iterdir() if p.name.startswith("index.sqlite3.damaged-")]
    assert len(moved) == 1 and (directory / moved[0]).read_bytes().startswith(b"this is not a database")
    assert not bad.exists()
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    message = record.getMessage()
    assert f"the index {index} was unreadable (file is not a database), moved to {moved[0]}" in message
    assert "rebuilt the index from the entry files: 4 entries, 1 unusable or expired files deleted" in message
    with PersistentStore(directory, IDENTITY, clock=clock) as again:  # the new index is a plain index now
        assert again.enabled and len(again) == 4


def test_a_deleted_index_is_rebuilt_and_the_ttl_counts_from_creation(
    tmp_path: Path, clock: ManualClock
) -> None:
    directory = tmp_path / "ssd"
    keys = _fill(directory, clock, 2)
    clock.advance(50.0)
    with PersistentStore(directory, IDENTITY, ttl_s=100.0, clock=clock) as s:
        assert s.put(key_of(5), tokens_of(5), payload_of(5))  # created at t = 50
    for name in ("index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"):
        (directory / name).unlink(missing_ok=True)
    clock.advance(60.0)  # t = 110: the first two expired at 100, the third lives until 150
    with PersistentStore(directory, IDENTITY, ttl_s=100.0, clock=clock) as s:
        assert s.enabled and len(s) == 1
        assert s.get(key_of(5), tokens_of(5)) == payload_of(5)
        assert s.get_many(keys, [tokens_of(0), tokens_of(1)]) == [None, None]
    assert not entry_path(directory, keys[0]).exists()  # expired files are deleted, not indexed


def test_an_index_of_a_newer_kvdiet_is_left_alone(
    tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    directory = tmp_path / "ssd"
    _fill(directory, clock, 1)
    db = sqlite3.connect(directory / "index.sqlite3")
    db.execute("PRAGMA user_version=7")
    db.close()
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        PersistentStore(directory, IDENTITY, clock=clock) as s,
    ):
        assert not s.enabled
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "index schema version 7, this kvdiet reads 1 (written by a newer kvdiet?)" in record.getMessage()
    assert str(directory / "index.sqlite3") in record.getMessage()
    assert not [p for p in directory.iterdir() if "damaged" in p.name]


def test_a_folder_starting_with_a_tilde_is_under_home(tmp_path, monkeypatch) -> None:
    """``--persistent-dir '~/pd'`` (quoted, or ``--persistent-dir=~/pd``: the shell leaves it) was checked under
    $HOME and then used literally: ``./~/pd`` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with PersistentStore("~/pd", IDENTITY, clock=ManualClock(0.0)) as store:
        assert store.enabled and store.put(key_of(0), tokens_of(0), payload_of(0))
    assert (tmp_path / "home" / "pd" / "index.sqlite3").is_file() and not (tmp_path / "~").exists()
