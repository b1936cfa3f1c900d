"""Several processes on one persistent directory: index and files agree, writers of one block leave one valid
entry, an eviction in one process never deletes a file another just wrote, each reads the other's blocks.
(Two `kvdiet generate` processes on one directory: tests/test_generate_cli.py.)"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import threading
from pathlib import Path

import pytest

from kvdiet.storage import persistent
from kvdiet.storage.persistent import PersistentStore, StoreIdentity

BLOCK = 4
IDENTITY = StoreIdentity(fingerprint="ab" * 32, formats=("fp4_e2m1_e4m3x16", "mxfp4"), block_size=BLOCK)
SIZE = 300  # payload bytes; an entry file is ~470 B


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def tokens_of(i: int) -> list[int]:
    return [1000 + i * BLOCK + j for j in range(BLOCK)]


def payload_of(i: int, writer: int = 0) -> bytes:
    return random.Random(i * 7919 + writer).randbytes(SIZE)


def index_rows(directory: Path) -> set[str]:
    with PersistentStore(directory, IDENTITY) as store:
        return {k.hex() for (k,) in store._db.execute("SELECT key FROM entries")}


def entry_files(directory: Path) -> set[str]:
    return {p.name.removesuffix(".kvb") for p in (directory / "blocks").rglob("*.kvb")}


def test_eviction_by_one_store_never_deletes_a_file_another_store_just_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A evicts block 0 while B (another store on the same directory, as another process) writes block 0
    again. Whatever the interleaving, the index and the files must agree afterwards: a row whose file an
    eviction removed would be promised by `contains_prefix` and missed by `get`."""
    entry = len(_entry_file_bytes(tmp_path / "probe", 0))
    a = PersistentStore(
        tmp_path, IDENTITY, capacity_bytes=2 * entry + 20
    )  # two entries (their lengths vary by a byte or two)
    b = PersistentStore(tmp_path, IDENTITY)
    with a, b:
        assert a.put(key_of(0), tokens_of(0), payload_of(0)) and a.put(key_of(1), tokens_of(1), payload_of(1))
        real_unlink, raced = persistent.unlink, []
        threads: list[threading.Thread] = []

        def unlink_while_b_writes(path: str) -> None:
            if key_of(0).hex() in path and not raced:
                raced.append(1)  # B writes block 0 now, between A's eviction of it and A's unlink
                threads.append(
                    threading.Thread(target=b.put, args=(key_of(0), tokens_of(0), payload_of(0, 1)))
                )
                threads[0].start()
                threads[0].join(timeout=2.0)  # B is done, or waits for A's transaction to end
            real_unlink(path)

        monkeypatch.setattr(persistent, "unlink", unlink_while_b_writes)
        assert a.put(key_of(2), tokens_of(2), payload_of(2))  # evicts block 0, the least recently read
        monkeypatch.undo()
        assert raced == [1] and a.counters.evictions == 1
        threads[0].join(timeout=30)
        promised = b.contains_prefix([key_of(0)])
        got = b.get(key_of(0), tokens_of(0))
        assert (promised == 1) == (got is not None)  # the index never promises a block with no file
        assert got in (None, payload_of(0, 1))
        assert b.counters.corrupt_dropped == 0
    assert index_rows(tmp_path) == entry_files(tmp_path)


def _open_at_once(store: PersistentStore, barrier: threading.Barrier) -> None:
    barrier.wait(timeout=30)
    store.open()


def test_stores_opening_one_new_directory_at_once_all_open(tmp_path: Path) -> None:
    """Several stores (as several processes started together) open one new directory at the same moment:
    every one is enabled. SQLite refuses the switch of a new index to WAL at once, without waiting, while
    another connection holds a lock; a store that took that as a failure ran with its tier off (CI
    caught it in the two-process test below)."""
    refused = []
    for trial in range(40):
        directory, barrier = tmp_path / str(trial), threading.Barrier(6)
        stores = [PersistentStore(directory, IDENTITY) for _ in range(6)]

        threads = [threading.Thread(target=_open_at_once, args=(s, barrier)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        refused += [(trial, i) for i, s in enumerate(stores) if not s.enabled]
        assert stores[0].put(key_of(trial), tokens_of(trial), payload_of(trial)) == stores[0].enabled
        for s in stores:
            s.close()
    assert refused == []


def _entry_file_bytes(directory: Path, i: int) -> bytes:
    with PersistentStore(directory, IDENTITY) as s:
        s.put(key_of(i), tokens_of(i), payload_of(i))
    return (directory / "blocks" / key_of(i).hex()[:2] / f"{key_of(i).hex()}.kvb").read_bytes()


def _hammer(directory: str, writer: int, keys: int, capacity: int, barrier, results) -> None:
    """Spawned: writes and reads shared keys under a small capacity (evictions in both processes), then
    writes its own keys and reads the other writer's."""
    wrong: list[str] = []
    rng = random.Random(writer)
    reads = hits = 0
    with PersistentStore(directory, IDENTITY, capacity_bytes=capacity) as store:
        barrier.wait(timeout=60)
        for _ in range(400):
            i = rng.randrange(keys)
            if rng.random() < 0.5:
                if not store.put(key_of(i), tokens_of(i), payload_of(i, writer)):
                    wrong.append(f"put {i} refused")
            else:
                got = store.get(key_of(i), tokens_of(i))
                reads, hits = reads + 1, hits + (got is not None)
                if got not in (None, payload_of(i, 0), payload_of(i, 1)):
                    wrong.append(f"wrong bytes for {i}")
        counters = store.counters.as_dict()
        enabled = store.enabled
    barrier.wait(timeout=60)
    with PersistentStore(directory, IDENTITY) as store:  # no capacity: the own blocks all stay
        mine = [10_000 * (writer + 1) + i for i in range(20)]
        theirs = [10_000 * (2 - writer) + i for i in range(20)]
        store.put_many([(key_of(i), tokens_of(i), payload_of(i)) for i in mine])
        barrier.wait(timeout=60)
        got = store.get_many([key_of(i) for i in theirs], [tokens_of(i) for i in theirs])
        wrong += [f"theirs {i}" for i, g in zip(theirs, got, strict=True) if g != payload_of(i)]
    results.put((writer, wrong, enabled, reads, hits, counters))


def test_two_processes_with_evictions_keep_index_and_files_in_step(tmp_path: Path) -> None:
    keys, entry = 16, len(_entry_file_bytes(tmp_path / "probe", 0))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_hammer, args=(str(tmp_path / "d"), w, keys, 6 * entry, barrier, results))
        for w in (0, 1)
    ]
    for p in procs:
        p.start()
    reports = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for writer, wrong, enabled, reads, hits, counters in reports:
        assert (wrong, enabled) == ([], True), writer
        assert reads > 100 and 0 < hits < reads  # both hits and misses: evictions happened
        assert (
            counters["evictions"] > 0 and counters["corrupt_dropped"] == 0 and counters["write_errors"] == 0
        )
    d = tmp_path / "d"
    assert index_rows(d) == entry_files(d)  # no row without its file, no file without its row
    with PersistentStore(d, IDENTITY) as store:
        for i in range(keys):  # every surviving shared entry is one writer's whole, valid entry
            assert store.get(key_of(i), tokens_of(i)) in (None, payload_of(i, 0), payload_of(i, 1))
        assert store.counters.corrupt_dropped == 0
    assert not [p for p in (d / "blocks").rglob("*") if p.name.endswith(".tmp")]
