"""MooncakeSwaPool against a real mooncake_master (and standalone mooncake_client segment holders): the
in-process pool's semantics, the TTL kvdiet keeps in each value's header, upsert overwrites, the value layout,
damage, and every fault: down at start-up, killed and restarted, a value removed between its size and its
read, over capacity, a segment owner that exits."""

from __future__ import annotations

import logging
import random
import struct
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path

import pytest

from kvdiet.cli import main
from kvdiet.storage.clock import ManualClock
from kvdiet.storage.mooncake_header import HEADER
from kvdiet.storage.mooncake_pool import MooncakeSwaPool
from kvdiet.storage.mooncake_urls import parse_mooncake_url
from kvdiet.storage.swa_pool import InProcessSwaPool
from kvdiet.storage.swa_pool_factory import check_swa_pool_spec, create_swa_pool
from mooncake_helpers import MooncakeMaster, SegmentHolder, master_with_segment, raw_client_of
from redis_helpers import free_port

LOGGER = "kvdiet.storage.mooncake_pool"


master = pytest.fixture(scope="module")(master_with_segment)
raw = pytest.fixture(scope="module")(raw_client_of)


@pytest.fixture
def ns() -> str:
    return uuid.uuid4().hex


def _pool(url: str, ns: str, **kw) -> MooncakeSwaPool:
    pool = MooncakeSwaPool(url, namespace=ns, segment_bytes=kw.pop("segment_bytes", 0), **kw)
    pool.open()
    return pool


def _name(ns: str, key: bytes) -> str:
    return f"kvdiet:swa:{ns}:{key.hex()}"


# --- arguments ---


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("mooncake://", "names no master host"),
        ("mooncake://:50051", "names no master host"),
        ("mooncake://127.0.0.1:99999", "Port out of range"),
        ("mooncake://127.0.0.1:0", "outside 1-65535"),
        ("mooncake://127.0.0.1:50051/x", "no path"),
        ("mooncake://u:p@127.0.0.1:50051", "no path, user"),
        ("mooncake://127.0.0.1:50051?segment=1", "unknown option segment"),
        ("mooncake://127.0.0.1:50051?local_host=a&local_host=b", "given twice"),
        ("mooncake://127.0.0.1:50051?local_host=myhost", "not an IP address"),
    ],
)
def test_bad_urls_raise_before_any_io(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_mooncake_url(spec)
    with pytest.raises(ValueError, match=needle):
        MooncakeSwaPool(spec, namespace="ab")
    with pytest.raises(ValueError, match=needle):
        check_swa_pool_spec(spec)


def test_good_specs_and_bad_settings() -> None:
    url = parse_mooncake_url(" mooncake://10.0.0.1?local_host=10.0.0.11 ")
    assert (url.host, url.port, url.local_host, url.master) == (
        "10.0.0.1",
        50051,
        "10.0.0.11",
        "10.0.0.1:50051",
    )
    assert parse_mooncake_url("mooncake://[::1]:7").master == "[::1]:7"
    assert check_swa_pool_spec(" mooncake://127.0.0.1:1 ") == "mooncake://127.0.0.1:1"
    pool = create_swa_pool("mooncake://127.0.0.1:1", namespace="ab", ttl_s=7, capacity_bytes=0)
    assert isinstance(pool, MooncakeSwaPool) and (pool.ttl_s, pool.segment_bytes) == (7.0, 0)
    assert repr(pool).startswith("Mooncake SWA pool (mooncake://127.0.0.1:1; TTL 7 s, segment 0 B")
    for kw, needle in [
        ({"namespace": ""}, "namespace"),
        ({"namespace": "a:b"}, "namespace"),
        ({"namespace": "ab", "ttl_s": 0}, "> 0"),
        ({"namespace": "ab", "connect_timeout_s": 0}, "> 0"),
        ({"namespace": "ab", "segment_bytes": -1}, "segment_bytes"),
        ({"namespace": "ab", "local_buffer_bytes": 1000}, "local_buffer_bytes"),
        ({"namespace": "ab", "backoff_s": -1}, "backoff_s"),
    ]:
        with pytest.raises(ValueError, match=needle):
            MooncakeSwaPool("mooncake://127.0.0.1:1", **kw)


def test_cli_rejects_a_bad_mooncake_url_with_exit_2(capsys) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    assert main([*argv, "--swa-pool", "mooncake://127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet generate: error: --swa-pool") and err.count("\n") == 1


# --- the SwaPool protocol, as the in-process pool has it ---


def test_same_answers_and_counters_as_the_in_process_pool(master: MooncakeMaster, ns: str) -> None:
    rng = random.Random(0)
    values = {k: rng.randbytes(n) for k, n in [(b"a", 0), (b"b", 1), (b"c", 999), (b"d", 3000), (b"e", 4096)]}
    mem = InProcessSwaPool(1 << 20, ttl_s=60)
    pool = _pool(master.url, ns, ttl_s=60)
    try:
        for p in (mem, pool):
            for k, v in values.items():
                assert p.put(k, bytearray(v) if k == b"c" else memoryview(v) if k == b"d" else v) is True
            assert p.put(b"e", b"overwritten") is True  # upsert: Mooncake's put would keep the old value
            batch = [(b"f", None, b"1" * 10), (b"g", None, bytearray(b"2" * 70_000)), (b"b", None, b"new b")]
            assert p.put_many(batch) == 3  # one batch_upsert_from, an overwrite in it
        for keys in [[b"a"], [b"zz"], [b"d", b"zz", b"d", b"e"], [], [b"c", b"b", b"a"], [b"g", b"f"]]:
            got = pool.get_many(keys)
            assert got == mem.get_many(keys) and all(type(v) is bytes for v in got if v is not None)
        for p in (mem, pool):
            assert p.get(b"d") == values[b"d"] and p.get(b"e") == b"overwritten"
        fields = ("lookups", "hits", "entries_written", "bytes_written", "bytes_read", "evictions")
        assert {f: getattr(pool.counters, f) for f in fields} == {f: getattr(mem.counters, f) for f in fields}
        assert pool.counters.lookups == 13 and pool.counters.hits == 11
        assert (pool.counters.corrupt_dropped, pool.counters.backend_errors, pool.counters.write_errors) == (
            0,
            0,
            0,
        )
        assert pool.contains_prefix([b"a", b"b", b"zz", b"c"]) == 2 and pool.contains_prefix([]) == 0
        assert pool.discard_many([b"a", b"zz"]) == 1 and pool.get(b"a") is None
        assert pool.reachable and len(pool) == 0 and pool.nbytes == 0  # the client reports no usage
    finally:
        pool.close()


def test_value_is_a_header_then_the_raw_payload(master: MooncakeMaster, ns: str, raw) -> None:
    clock = ManualClock(1_000.0)
    pool = _pool(master.url, ns, ttl_s=30, clock=clock)
    value = random.Random(1).randbytes(2500)
    try:
        assert pool.put(b"\x01\x02", value)
        stored = raw.get(_name(ns, b"\x01\x02"))
        magic, version, flags, deadline, length, crc, head_crc = HEADER.unpack_from(stored)
        assert (magic, version, flags, deadline, length, crc) == (
            b"KVMC",
            1,
            0,
            1_030.0,
            2500,
            zlib.crc32(value),
        )
        assert head_crc == zlib.crc32(stored[:28]) and HEADER.size == 32 and stored[32:] == value  # raw bytes
    finally:
        pool.close()


def test_ttl_is_kept_in_the_header_and_an_expired_value_is_removed(
    master: MooncakeMaster, ns: str, raw
) -> None:
    clock = ManualClock(1_000.0)
    pool = _pool(master.url, ns, ttl_s=10, clock=clock)
    try:
        assert pool.put(b"k", b"x" * 250)
        clock.set(1_009.999)
        for _ in range(3):
            assert pool.get(b"k") == b"x" * 250  # reads never move the deadline
        clock.set(1_010.0)  # exclusive at the deadline
        assert pool.get(b"k") is None and pool.counters.expirations == 1
        assert raw.is_exist(_name(ns, b"k")) == 0  # removed, though just read (a forced remove)
        assert pool.get(b"k") is None and pool.counters.expirations == 1  # now a plain miss
        assert pool.counters.corrupt_dropped == pool.counters.evictions == 0
        assert pool.put(b"k", b"again") and pool.get(b"k") == b"again"  # a new value, a new deadline
    finally:
        pool.close()


def _with_crc(head: bytes) -> bytes:
    return head + struct.pack("<I", zlib.crc32(head))


DAMAGE = {
    "payload byte flipped": lambda v: v[:40] + bytes([v[40] ^ 1]) + v[41:],
    "payload truncated": lambda v: v[:-1],
    "payload extended": lambda v: v + b"\0",
    "header only": lambda v: v[:32],
    "shorter than a header": lambda v: v[:31],
    "header bit flipped": lambda v: v[:20] + bytes([v[20] ^ 1]) + v[21:],
    "bad magic": lambda v: _with_crc(b"XXXX" + v[4:28]) + v[32:],
    "other version": lambda v: _with_crc(v[:4] + b"\x02\x00" + v[6:28]) + v[32:],
    "deadline not finite": lambda v: _with_crc(v[:8] + struct.pack("<d", float("nan")) + v[16:28]) + v[32:],
    "not ours at all": lambda v: b"something else entirely" * 10,
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_value_is_a_miss_counted_and_removed(master: MooncakeMaster, ns: str, raw, damage) -> None:
    pool = _pool(master.url, ns)
    value = random.Random(2).randbytes(2500)
    try:
        assert pool.put(b"k", value) and pool.put(b"other", b"kept")
        name = _name(ns, b"k")
        assert raw.upsert(name, DAMAGE[damage](raw.get(name))) == 0
        assert pool.get_many([b"other", b"k", b"other"]) == [b"kept", None, b"kept"]
        c = pool.counters
        assert (c.corrupt_dropped, c.evictions, c.expirations, c.backend_errors) == (1, 0, 0, 0)
        assert raw.is_exist(name) == 0
        assert pool.get(b"k") is None and c.corrupt_dropped == 1  # now a plain miss
        assert pool.put(b"k", value) and pool.get(b"k") == value
    finally:
        pool.close()


class _RemoveBeforeRead:
    """The pool's client, except that every value is removed (as an eviction would) just before the read."""

    def __init__(self, store, raw) -> None:
        self.store, self.raw = store, raw

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def batch_get_into(self, keys, ptrs, sizes):
        for k in keys:
            assert self.raw.remove(k, True) == 0
        return self.store.batch_get_into(keys, ptrs, sizes)


def test_a_value_removed_between_its_size_and_its_read_is_an_eviction(
    master: MooncakeMaster, ns: str, raw
) -> None:
    pool = _pool(master.url, ns)
    try:
        assert pool.put(b"k", b"v" * 3000) and pool.put(b"j", b"w" * 10)
        pool._conn.store = _RemoveBeforeRead(pool._conn.store, raw)
        assert pool.get_many([b"k", b"j", b"absent"]) == [None, None, None]
        c = pool.counters
        assert (c.evictions, c.corrupt_dropped, c.backend_errors, c.hits) == (2, 0, 0, 0)
        pool._conn.store = pool._conn.store.store
        assert pool.get(b"k") is None and c.evictions == 2  # now a plain miss
    finally:
        pool.close()


def test_namespaces_do_not_see_each_other(master: MooncakeMaster) -> None:
    one, two = _pool(master.url, uuid.uuid4().hex), _pool(master.url, uuid.uuid4().hex)
    try:
        assert one.put(b"k", b"model one") and two.put(b"k", b"model two")
        assert one.get(b"k") == b"model one" and two.get(b"k") == b"model two"
        assert one.put(b"only-one", b"x") and two.get(b"only-one") is None
    finally:
        one.close()
        two.close()


def test_another_process_reads_what_this_one_wrote(master: MooncakeMaster, ns: str) -> None:
    pool = _pool(master.url, ns)
    value = random.Random(3).randbytes(2_770_000)  # a V4.1-Flash snapshot's size
    try:
        assert pool.put(b"snap", value)
        code = (
            "import sys, zlib; from kvdiet.storage.mooncake_pool import MooncakeSwaPool\n"
            f"p = MooncakeSwaPool({master.url!r}, namespace={ns!r}, segment_bytes=0); p.open()\n"
            "v = p.get(b'snap'); print(len(v), zlib.crc32(v)); p.put(b'back', v[:10]); p.close()\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == [str(len(value)), str(zlib.crc32(value))]
        assert pool.get(b"back") == value[:10]  # held by the segment holder, not the exited process
    finally:
        pool.close()


# --- faults ---


def test_down_at_start_up_warns_once_misses_and_recovers(tmp_path: Path, caplog) -> None:
    port = free_port()
    pool = MooncakeSwaPool(f"mooncake://127.0.0.1:{port}", namespace="ns", segment_bytes=16 << 20)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        t0 = time.monotonic()
        pool.open()  # a refused connection, not Mooncake's own 90 s setup timeout
        assert pool.put(b"k", b"v") is False and pool.get(b"k") is None
        assert pool.get_many([b"k", b"j"]) == [None, None] and pool.contains_prefix([b"k"]) == 0
        for _ in range(200):  # inside the back-off: no connection attempt at all
            assert pool.get(b"k") is None
        assert pool.put_many([(b"a", None, b"1"), (b"b", None, b"2")]) == 0
        assert time.monotonic() - t0 < 1.0
        c = pool.counters
        assert (c.backend_errors, c.write_errors, c.lookups) == (1, 3, 203) and not pool.reachable
        warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable at start-up" in warnings[0].getMessage()
        assert (
            f"127.0.0.1:{port}" in warnings[0].getMessage() and "bounded replay" in warnings[0].getMessage()
        )
        with MooncakeMaster(tmp_path, port=port):
            time.sleep(1.05)
            assert pool.put(b"k", b"v") is True and pool.get(b"k") == b"v" and pool.reachable
            pool.close()
        assert any("reachable again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_killed_mid_run_then_restarted_on_the_same_port(tmp_path: Path, caplog) -> None:
    with MooncakeMaster(tmp_path) as master:
        pool = _pool(master.url, "ns", backoff_s=0.3, segment_bytes=16 << 20)
        try:
            assert pool.put(b"k", b"v" * 3000) and pool.get(b"k") == b"v" * 3000
            master.stop()
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                t0 = time.monotonic()
                assert pool.get(b"k") is None  # a lost connection: a miss, not an exception
                # at once, or when Mooncake's own reconnect gives up (~4.5 s idle, 8.8 s seen on a loaded 2-core
                # machine): bounded, not a hang; the back-off's speed is held by the 1 s bound below
                assert time.monotonic() - t0 < 30.0
                t1 = time.monotonic()
                assert pool.put(b"j", b"w") is False  # inside the back-off now
                time.sleep(0.35)
                # past the back-off: the port is checked, still closed
                assert pool.get_many([b"k", b"j"]) == [None, None]
                assert time.monotonic() - t1 < 1.0  # never again Mooncake's ~4.5 s per call on a dead master
            c = pool.counters
            assert c.backend_errors == 2 and c.write_errors == 1 and c.hits == 1 and not pool.reachable
            assert len(caplog.records) == 1 and "lookup failed (error -900)" in caplog.records[0].getMessage()
            master.start()  # same port, empty: a restarted master knows no keys
            time.sleep(0.35)
            assert pool.get(b"k") is None and pool.reachable  # the client reconnected by itself
            deadline = time.monotonic() + 60  # writes are refused (-200) until the segment is mounted again
            while not pool.put(b"k", b"new"):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert pool.get(b"k") == b"new"
        finally:
            pool.close()


def test_over_capacity_writes_are_refused_and_the_master_evicts_the_oldest(tmp_path: Path) -> None:
    with MooncakeMaster(tmp_path) as master, SegmentHolder(tmp_path, master, segment_bytes=16 << 20):
        pool = _pool(master.url, "ns")
        try:
            values = {b"k%d" % i: random.Random(i).randbytes(1 << 20) for i in range(24)}  # 24 MiB into 16
            stored = [pool.put(k, v) for k, v in values.items()]
            # some refused (-200), not an exception; not necessarily the last ones: the master's background
            # eviction may free room while the later puts run
            assert stored[0] and not all(stored)
            assert pool.counters.write_errors == stored.count(False) > 0
            deadline = time.monotonic() + 15  # the master evicts in the background from 90% full
            while not pool.put(b"later", b"x" * (1 << 20)):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            got = pool.get_many(list(values))
            assert all(g is None or g == values[k] for k, g in zip(values, got, strict=True))
            assert got[0] is None and any(g is not None for g in got)  # the oldest went first
            assert pool.counters.corrupt_dropped == 0
        finally:
            pool.close()


def test_a_segment_owner_that_exits_takes_its_values_with_it(tmp_path: Path) -> None:
    """Values live in the memory of the process whose segment holds them: a pool that contributes a segment
    (and is the only one) loses its values when it closes; a killed holder's values fail to read at once
    (a miss) and leave the master's index within its --client_ttl."""
    with MooncakeMaster(tmp_path) as master:
        owner = _pool(master.url, "ns", segment_bytes=16 << 20)
        reader = _pool(master.url, "ns")
        assert owner.put(b"k", b"v" * 1000) and reader.get(b"k") == b"v" * 1000
        owner.close()
        assert reader.get(b"k") is None and reader.counters.backend_errors == 0  # gone: a plain miss
        with SegmentHolder(tmp_path, master) as holder:
            assert reader.put(b"k", b"w" * 1000) and reader.get(b"k") == b"w" * 1000
            holder.stop()  # SIGKILL
            assert reader.get(b"k") is None and reader.counters.backend_errors == 1  # transfer failed
            assert reader.reachable  # the master is fine: no back-off
        reader.close()
