"""The persistent tier read-only (``--persistent-read-only``, or a folder or index this process may not write): its
entries are served, nothing in the folder is made, changed or removed, and a refusal is one warning."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from kvdiet.cli import main
from kvdiet.storage import index_open
from kvdiet.storage.clock import ManualClock
from kvdiet.storage.persistent import PersistentStore
from test_storage_persistent import IDENTITY, LOGGER, entry_path, key_of, payload_of, tokens_of

KEYS = 5


def _written(directory: Path, clock: ManualClock) -> None:
    with PersistentStore(directory, IDENTITY, ttl_s=10.0, clock=clock) as store:
        assert store.put_many([(key_of(i), tokens_of(i), payload_of(i)) for i in range(KEYS)]) == KEYS


def _listing(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``directory``: (size, mtime in ns, bytes)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_read_only_serves_the_entries_and_changes_nothing(tmp_path: Path, caplog) -> None:
    clock, folder = ManualClock(), tmp_path / "ssd"
    _written(folder, clock)
    entry_path(folder, key_of(3)).unlink()  # a row without its file
    damaged = entry_path(folder, key_of(4))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")  # a checksum that fails
    before = _listing(folder)
    clock.advance(5.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = PersistentStore(folder, IDENTITY, ttl_s=10.0, clock=clock, read_only=True)
        store.open()
        assert store.enabled and store.read_only
        keys, tokens = [key_of(i) for i in range(KEYS)], [tokens_of(i) for i in range(KEYS)]
        assert store.get_many(keys, tokens) == [payload_of(0), payload_of(1), payload_of(2), None, None]
        assert store.contains_prefix(keys) == KEYS  # the index's rows, as written
        assert store.put(key_of(9), tokens_of(9), payload_of(9)) is False
        assert store.put_many([(key_of(8), tokens_of(8), payload_of(8))]) == 0
        assert store.sweep() == 0
        assert store.get(key_of(4), tokens_of(4)) is None  # the corrupt one again: counted and warned of once
        clock.advance(10.0)  # past every entry's TTL: a miss, the row kept
        assert store.get(key_of(0), tokens_of(0)) is None and len(store) == KEYS
        store.close()
    assert _warnings(caplog) == [f"read-only persistent tier {folder}: corrupt entries kept: 1"]
    c = store.counters
    assert (c.hits, c.lookups, c.entries_written, c.expirations, c.corrupt_dropped) == (3, 7, 0, 0, 1)
    assert _listing(folder) == before  # no file made (no journal, no shared memory), changed or removed


def test_a_folder_this_process_may_not_write_is_read_read_only(tmp_path: Path, monkeypatch, caplog) -> None:
    """Root writes through permissions (os.access says yes), so the refusal is staged: os.access says no."""
    clock, folder = ManualClock(), tmp_path / "ssd"
    _written(folder, clock)
    before = _listing(folder)
    monkeypatch.setattr(index_open.os, "access", lambda path, mode: False)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        PersistentStore(folder, IDENTITY, clock=clock) as store,
    ):
        assert store.enabled and store.read_only
        assert store.get(key_of(1), tokens_of(1)) == payload_of(1)
        assert store.put(key_of(9), tokens_of(9), payload_of(9)) is False
    (warning,) = _warnings(caplog)
    assert "read-only: the folder is not writable by this process" in warning and str(folder) in warning
    assert _listing(folder) == before


def test_an_index_that_will_not_open_for_writing_is_read_read_only(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A read-only volume: the folder passes os.access (root), the index's write fails as SQLite says it."""
    clock, folder = ManualClock(), tmp_path / "ssd"
    _written(folder, clock)

    def readonly(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(index_open, "connect", readonly)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        PersistentStore(folder, IDENTITY, clock=clock) as store,
    ):
        assert store.enabled and store.read_only
        assert store.get(key_of(2), tokens_of(2)) == payload_of(2)
    (warning,) = _warnings(caplog)
    assert "the index will not open for writing (attempt to write a readonly database)" in warning
    # a broken index is no read-only one: the write error is reported as before, the tier off
    monkeypatch.setattr(index_open, "connect", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error")))
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        PersistentStore(folder, IDENTITY, clock=clock) as store,
    ):
        assert not store.enabled
    assert [w.split(":")[0] for w in _warnings(caplog)] == ["persistent tier disabled"]


@pytest.mark.parametrize("index", ["none", "newer", "not sqlite"])
def test_read_only_without_a_readable_index_is_off_with_one_warning(tmp_path: Path, caplog, index) -> None:
    folder = tmp_path / "ssd"
    folder.mkdir()
    if index == "newer":
        with sqlite3.connect(folder / "index.sqlite3") as db:
            db.execute(
                "CREATE TABLE entries (key BLOB PRIMARY KEY, identity, size, created, expires, last_access)"
            )
            db.execute("PRAGMA user_version=2")
    elif index == "not sqlite":
        (folder / "index.sqlite3").write_bytes(b"x" * 4096)
    before = _listing(folder)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = PersistentStore(folder, IDENTITY, clock=ManualClock(), read_only=True)
        store.open()
        assert not store.enabled and store.get(key_of(0), tokens_of(0)) is None
        store.close()
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"persistent tier disabled: cannot read the index {folder / 'index.sqlite3'}")
    if index == "newer":
        assert "index schema version 2, this kvdiet reads 1" in warning
    if index == "none":
        assert warning.endswith("no index file (a folder no kvdiet persistent tier has written)")
    assert _listing(folder) == before and sorted(p.name for p in folder.iterdir()) == sorted(before)


def test_read_only_entries_without_their_index_say_how_to_rebuild_it(tmp_path: Path, caplog) -> None:
    """A folder kvdiet wrote, its index since removed: read-only it is not rebuilt (a writable one is), and the
    warning says that, not that no tier ever wrote there."""
    folder = tmp_path / "ssd"
    _written(folder, ManualClock())
    (folder / "index.sqlite3").unlink()
    before = _listing(folder)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = PersistentStore(folder, IDENTITY, clock=ManualClock(), read_only=True)
        store.open()
        assert not store.enabled
    (warning,) = _warnings(caplog)
    assert warning == (
        f"persistent tier disabled: {folder} holds entry files but no index (index.sqlite3), and read-only it is "
        "not rebuilt; open the folder once where it may be written and kvdiet rebuilds the index from them"
    )
    assert _listing(folder) == before
    with PersistentStore(folder, IDENTITY, clock=ManualClock()) as store:  # writable: rebuilt, served
        assert store.get(key_of(1), tokens_of(1)) == payload_of(1)


def test_the_flag_needs_a_folder_that_is_there(tmp_path: Path, capsys) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--persistent-read-only"]
    assert main(argv) == 2
    assert "--persistent-read-only: no --persistent-dir is given" in capsys.readouterr().err
    assert main([*argv, "--persistent-dir", str(tmp_path / "missing")]) == 2
    assert f"--persistent-read-only: '{tmp_path / 'missing'}' is no folder to read" in capsys.readouterr().err
    assert main([*argv, "--persistent-dir", "None"]) == 2
    assert (
        "--persistent-read-only: the persistent tier is off (--persistent-dir none)"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "missing").exists()
