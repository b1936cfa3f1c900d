"""RedisSwaPool against real redis-server processes: the in-process pool's semantics, real PX expiry, chunks
behind a commit marker, damage, namespaces, pipelining, sharding, a Redis Cluster, and every fault: down at
start-up, killed and restarted, unanswered, keys evicted between the manifest and the chunks."""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvdiet.cli import main
from kvdiet.storage.redis_manifest import MANIFEST
from kvdiet.storage.redis_pool import RedisSwaPool
from kvdiet.storage.redis_urls import parse_redis_urls
from kvdiet.storage.swa_pool import InProcessSwaPool
from kvdiet.storage.swa_pool_factory import check_swa_pool_spec, create_swa_pool
from redis_helpers import RedisServer, cluster_port, free_port

LOGGER = "kvdiet.storage.redis_pool"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``$KVDIET_TEST_REDIS_URL`` (a server of your own, when set), else a server of this module's own."""
    if url := os.environ.get("KVDIET_TEST_REDIS_URL"):
        yield url
        return
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def ns() -> str:
    """A namespace of this test's own, so tests sharing one server never see each other's keys."""
    return uuid.uuid4().hex


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _pool(url: str, ns: str, **kw) -> RedisSwaPool:
    pool = RedisSwaPool(url, namespace=ns, **kw)
    pool.open()
    return pool


def _keys(raw: redis.Redis, ns: str) -> list[bytes]:
    return sorted(raw.scan_iter(match=f"kvdiet:swa:{{{ns}:*", count=1000))


# --- arguments ---


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "no Redis URL"),
        (" , ", "no Redis URL"),
        ("http://127.0.0.1:6379", "is not a Redis URL"),
        ("127.0.0.1:6379", "is not a Redis URL"),
        ("redis://127.0.0.1:99999/0", "Port out of range"),
        ("redis://127.0.0.1:0/0", "outside 1-65535"),
        ("redis://127.0.0.1:6379/x", "must be an integer"),
        ("redis://127.0.0.1:6379/1/2", "must be an integer"),
        ("redis://127.0.0.1:6379?db=x", "bad Redis URL"),
        ("redis://127.0.0.1:6379/0?fast=yes", "unknown option fast"),
        ("redis:///0", "names no host"),
        ("unix://", "names no socket path"),
        ("redis://a:1/0,redis://a:1", "listed twice"),
        ("redis+cluster://a:1,redis://b:2", "must be the only one"),
        ("redis+cluster://a:1/2", "only db 0"),
    ],
)
def test_bad_urls_raise_before_any_io(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_redis_urls(spec)
    with pytest.raises(ValueError, match=needle):
        RedisSwaPool(spec, namespace="ab")
    with pytest.raises(ValueError, match=needle):
        check_swa_pool_spec(spec)


def test_good_specs_and_bad_settings() -> None:
    assert parse_redis_urls(" redis://a:1/0 , redis://b/3,unix:///tmp/r.sock?db=2 ") == (
        "redis://a:1/0",
        "redis://b/3",
        "unix:///tmp/r.sock?db=2",
    )
    assert check_swa_pool_spec("in-process") == "in-process"
    assert isinstance(create_swa_pool("in-process", namespace="ab"), InProcessSwaPool)
    pool = create_swa_pool("redis://:secret@127.0.0.1:1/0", namespace="ab", ttl_s=7)
    assert isinstance(pool, RedisSwaPool) and pool.ttl_s == 7.0
    assert "secret" not in repr(pool) and "redis://:***@127.0.0.1:1/0" in repr(pool)
    for kw, needle in [
        ({"namespace": ""}, "namespace"),
        ({"namespace": "a{b}"}, "namespace"),
        ({"namespace": "ab", "ttl_s": 0}, "> 0"),
        ({"namespace": "ab", "socket_timeout_s": 0}, "> 0"),
        ({"namespace": "ab", "chunk_bytes": 0}, "chunk_bytes"),
        ({"namespace": "ab", "chunk_bytes": (512 << 20) + 1}, "chunk_bytes"),
        ({"namespace": "ab", "backoff_s": -1}, "backoff_s"),
    ]:
        with pytest.raises(ValueError, match=needle):
            RedisSwaPool("redis://127.0.0.1:1/0", **kw)


@pytest.mark.parametrize("spec", ["redis://127.0.0.1:99999/0", "memcached://x", "redis://a:1,redis://a:1"])
def test_cli_rejects_a_bad_swa_pool_with_exit_2(capsys, spec: str) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    assert main([*argv, "--swa-pool", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet generate: error: --swa-pool") and err.count("\n") == 1


# --- the SwaPool protocol, as the in-process pool has it ---


def test_same_answers_and_counters_as_the_in_process_pool(redis_url: str, ns: str) -> None:
    rng = random.Random(0)
    values = {k: rng.randbytes(n) for k, n in [(b"a", 0), (b"b", 1), (b"c", 999), (b"d", 3000), (b"e", 4096)]}
    mem = InProcessSwaPool(1 << 20, ttl_s=60)
    pool = _pool(redis_url, ns, ttl_s=60, chunk_bytes=1024)
    try:
        for p in (mem, pool):
            for k, v in values.items():
                assert p.put(k, bytearray(v) if k == b"c" else memoryview(v) if k == b"d" else v) is True
            assert p.put(b"e", b"overwritten") is True
        script = [[b"a"], [b"zz"], [b"d", b"zz", b"d", b"e"], [], [b"c", b"b", b"a"]]
        for keys in script:
            got_mem, got_redis = mem.get_many(keys), pool.get_many(keys)
            assert got_redis == got_mem
            assert all(type(v) is bytes for v in got_redis if v is not None)
        for p in (mem, pool):
            assert p.get(b"d") == values[b"d"] and p.get(b"e") == b"overwritten"
        fields = ("lookups", "hits", "entries_written", "bytes_written", "bytes_read", "evictions")
        assert {f: getattr(pool.counters, f) for f in fields} == {f: getattr(mem.counters, f) for f in fields}
        assert pool.counters.lookups == 11 and pool.counters.hits == 9
        assert (pool.counters.corrupt_dropped, pool.counters.backend_errors) == (0, 0)
        assert len(pool) > 0 and pool.nbytes > 0  # the server's figures
    finally:
        pool.close()


def test_ttl_is_real_px_expiry_and_reads_never_extend_it(redis_url: str, ns: str, raw: redis.Redis) -> None:
    pool = _pool(redis_url, ns, ttl_s=1.0, chunk_bytes=100)
    try:
        start = time.monotonic()
        assert pool.put(b"k", b"x" * 250)
        manifest = f"kvdiet:swa:{{{ns}:{b'k'.hex()}}}:m"
        first = raw.pttl(manifest)
        assert 0 < first <= 1000
        chunk_ttls = [raw.pttl(k) for k in _keys(raw, ns) if not k.endswith(b":m")]
        assert len(chunk_ttls) == 3 and all(1000 < t <= 2000 for t in chunk_ttls)  # the 1 s grace
        for _ in range(3):
            assert pool.get(b"k") == b"x" * 250
        assert raw.pttl(manifest) <= first  # reads did not move the deadline
        time.sleep(max(0.0, 1.05 - (time.monotonic() - start)))
        assert pool.get(b"k") is None and pool.get_many([b"k"]) == [None]
        assert raw.exists(manifest) == 0
        assert pool.counters.corrupt_dropped == pool.counters.evictions == 0  # expiry is a plain miss
        assert pool.put(b"k", b"again") and pool.get(b"k") == b"again"  # a new value, a new TTL
    finally:
        pool.close()


# --- chunks, the commit marker, damage ---


def test_chunk_layout_and_manifest(redis_url: str, ns: str, raw: redis.Redis) -> None:
    pool = _pool(redis_url, ns, chunk_bytes=1000)
    value = random.Random(1).randbytes(2500)
    try:
        assert pool.put(b"\x01\x02", value)
        keys = _keys(raw, ns)
        base = f"kvdiet:swa:{{{ns}:0102}}".encode()
        assert len(keys) == 4 and all(k.startswith(base + b":") for k in keys)  # one hash tag: one slot
        m = raw.get(base + b":m")
        magic, version, flags, nonce, count, total, crc, head_crc = MANIFEST.unpack(m)
        assert (magic, version, flags, count, total, crc) == (b"KVRS", 1, 0, 3, 2500, zlib.crc32(value))
        assert head_crc == zlib.crc32(m[:-4]) and len(m) == MANIFEST.size == 36
        chunks = [raw.get(base + f":{nonce.hex()}:{i}".encode()) for i in range(3)]
        assert [len(c) for c in chunks] == [1000, 1000, 500] and b"".join(chunks) == value  # raw bytes
        assert pool.put(b"\x01\x02", value[:2000])  # an overwrite: the old chunks go
        keys = _keys(raw, ns)
        assert len(keys) == 3 and not any(nonce.hex().encode() in k for k in keys)
        assert pool.get(b"\x01\x02") == value[:2000]
    finally:
        pool.close()


def _damage_manifest(raw: redis.Redis, base: bytes, fn) -> None:
    raw.set(base + b":m", fn(raw.get(base + b":m")), keepttl=True)


def _chunk_key(raw: redis.Redis, base: bytes, i: int) -> bytes:
    nonce = MANIFEST.unpack(raw.get(base + b":m"))[3]
    return base + f":{nonce.hex()}:{i}".encode()


def _flip_chunk_byte(raw: redis.Redis, base: bytes) -> None:
    key = _chunk_key(raw, base, 1)
    raw.setrange(key, 17, bytes([raw.getrange(key, 17, 17)[0] ^ 0x01]))


def _with_crc(head: bytes) -> bytes:
    return head + struct.pack("<I", zlib.crc32(head))


DAMAGE = {
    "chunk missing": ("evictions", lambda raw, base: raw.delete(_chunk_key(raw, base, 1))),
    "chunk byte flipped": ("corrupt_dropped", _flip_chunk_byte),
    "chunk truncated": (
        "corrupt_dropped",
        lambda raw, base: raw.set(_chunk_key(raw, base, 2), raw.get(_chunk_key(raw, base, 2))[:-1]),
    ),
    "manifest truncated": (
        "corrupt_dropped",
        lambda raw, base: _damage_manifest(raw, base, lambda m: m[:-1]),
    ),
    "manifest bad magic": (
        "corrupt_dropped",
        lambda raw, base: _damage_manifest(raw, base, lambda m: _with_crc(b"XXXX" + m[4:-4])),
    ),
    "manifest bit flip": (
        "corrupt_dropped",
        lambda raw, base: _damage_manifest(raw, base, lambda m: m[:20] + bytes([m[20] ^ 1]) + m[21:]),
    ),
    "manifest other version": (
        "corrupt_dropped",
        lambda raw, base: _damage_manifest(raw, base, lambda m: _with_crc(m[:4] + b"\x02\x00" + m[6:-4])),
    ),
    "manifest count too small": (  # a consistent manifest naming fewer chunks: the value is short
        "corrupt_dropped",
        lambda raw, base: _damage_manifest(
            raw, base, lambda m: _with_crc(m[:16] + struct.pack("<I", 2) + m[20:-4])
        ),
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_entry_is_a_miss_counted_and_deleted(
    redis_url: str, ns: str, raw: redis.Redis, damage
) -> None:
    counter, fn = DAMAGE[damage]
    pool = _pool(redis_url, ns, chunk_bytes=1000)
    value = random.Random(2).randbytes(2500)
    try:
        assert pool.put(b"k", value) and pool.put(b"other", b"kept")
        base = f"kvdiet:swa:{{{ns}:{b'k'.hex()}}}".encode()
        fn(raw, base)
        assert pool.get_many([b"other", b"k", b"other"]) == [b"kept", None, b"kept"]
        c = pool.counters
        assert getattr(c, counter) == 1 and c.corrupt_dropped + c.evictions == 1 and c.backend_errors == 0
        left = [k for k in _keys(raw, ns) if k.startswith(base)]
        if damage.startswith("chunk"):
            assert left == []  # manifest and chunks deleted
        else:  # chunks the bad manifest does not name are left to their TTL
            assert base + b":m" not in left and all(raw.pttl(k) > 0 for k in left)
            assert len(left) == (1 if damage == "manifest count too small" else 3)
        assert pool.get(b"k") is None and c.corrupt_dropped + c.evictions == 1  # now a plain miss
        assert pool.put(b"k", value) and pool.get(b"k") == value
    finally:
        pool.close()


def test_reader_never_sees_half_a_value_while_a_writer_overwrites(redis_url: str, ns: str) -> None:
    """Multi-chunk values A and B written alternately under one key while readers read it: every read is A,
    B or a miss (a reader whose manifest was replaced under it), and no miss counts as damage."""
    a, b = b"A" * 5000 + b"a", b"B" * 7000 + b"b"
    writer = _pool(redis_url, ns, chunk_bytes=1000)
    reader = _pool(redis_url, ns, chunk_bytes=1000)
    seen: list[bytes | None] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(reader.get(b"k"))

    try:
        writer.put(b"k", a)
        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(300):
            assert writer.put(b"k", a if i % 2 else b)
        stop.set()
        for t in threads:
            t.join()
        assert set(seen) <= {a, b, None} and seen.count(a) + seen.count(b) > 0
        c = reader.counters
        assert (c.corrupt_dropped, c.evictions, c.backend_errors) == (0, 0, 0)
        assert reader.get(b"k") == a
    finally:
        writer.close()
        reader.close()


def test_namespaces_do_not_see_each_other(redis_url: str) -> None:
    one, two = _pool(redis_url, uuid.uuid4().hex), _pool(redis_url, uuid.uuid4().hex)
    try:
        assert one.put(b"k", b"model one") and two.put(b"k", b"model two")
        assert one.get(b"k") == b"model one" and two.get(b"k") == b"model two"
        assert one.put(b"only-one", b"x") and two.get(b"only-one") is None
        assert two.counters.corrupt_dropped == 0
    finally:
        one.close()
        two.close()


def test_get_many_is_two_round_trips_and_put_one_transaction(
    redis_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(redis_url, ns, chunk_bytes=100)
    try:
        client = pool._servers[0].client
        real, made = client.pipeline, []

        def pipeline(*, transaction: bool = True, **kw):
            made.append(transaction)
            return real(transaction=transaction, **kw)

        monkeypatch.setattr(client, "pipeline", pipeline)
        assert pool.put(b"k0", b"v" * 450)  # 5 chunks + the manifest: one MULTI/EXEC
        assert made == [True]
        for i in range(1, 10):
            pool.put(b"k%d" % i, b"w" * (i * 60))
        made.clear()
        got = pool.get_many([b"k%d" % i for i in range(12)])
        assert made == [False, False]  # manifests, then every chunk
        assert got == [b"v" * 450] + [b"w" * (i * 60) for i in range(1, 10)] + [None, None]
    finally:
        pool.close()


def test_allkeys_lru_eviction_gives_whole_values_or_misses(tmp_path: Path) -> None:
    """A server with 4 MB of maxmemory and allkeys-lru evicts manifests and chunks independently (reads
    evict too: a reply's output buffer counts against maxmemory): every read is still the whole value or a
    miss, never an error, and a manifest whose chunk is gone counts as an eviction."""
    opts = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10"]
    with RedisServer(tmp_path, options=opts) as server:
        pool = _pool(server.url, "ns", chunk_bytes=16 << 10)
        try:
            values = {b"k%d" % i: random.Random(i).randbytes(100_000) for i in range(60)}  # 6 MB
            for k, v in values.items():
                assert pool.put(k, v)
            assert pool.get(b"k59") == values[b"k59"]  # the most recently written survives
            got = [pool.get(k) for k in values]
            assert all(g is None or g == values[k] for k, g in zip(values, got, strict=True))
            assert got[0] is None and redis.Redis(port=server.port).info("stats")["evicted_keys"] > 0
            c = pool.counters
            assert c.evictions > 0 and c.corrupt_dropped == 0 and c.backend_errors == 0
        finally:
            pool.close()


# --- faults ---


def test_down_at_start_up_warns_once_misses_and_recovers(tmp_path: Path, caplog) -> None:
    port = free_port()
    pool = RedisSwaPool(f"redis://127.0.0.1:{port}/0", namespace="ns", backoff_s=1.0)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        pool.open()
        assert pool.put(b"k", b"v") is False and pool.get(b"k") is None
        assert pool.get_many([b"k", b"j"]) == [None, None]
        for _ in range(200):  # inside the back-off: no connection attempt at all
            assert pool.get(b"k") is None
        assert pool.counters.backend_errors == 1  # the start-up PING only
        assert pool.counters.write_errors == 1 and pool.counters.lookups == 203 and not pool.reachable
        assert len(pool) == 0 and pool.nbytes == 0
        warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable at start-up" in warnings[0].getMessage()
        assert (
            f"127.0.0.1:{port}" in warnings[0].getMessage() and "bounded replay" in warnings[0].getMessage()
        )
        with RedisServer(tmp_path, port=port):
            time.sleep(1.05)
            assert pool.put(b"k", b"v") is True and pool.get(b"k") == b"v" and pool.reachable
        assert any("reachable again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    pool.close()


def test_killed_mid_run_then_restarted_on_the_same_port(tmp_path: Path, caplog) -> None:
    with RedisServer(tmp_path) as server:
        pool = _pool(server.url, "ns", backoff_s=0.3)
        try:
            assert pool.put(b"k", b"v" * 3000) and pool.get(b"k") == b"v" * 3000
            server.stop()
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                t0 = time.monotonic()
                assert pool.get(b"k") is None  # a lost connection: a miss, not an exception
                assert pool.put(b"j", b"w") is False  # inside the back-off now
                assert pool.get_many([b"k", b"j"]) == [None, None]
                assert time.monotonic() - t0 < 2.0
            c = pool.counters
            assert c.backend_errors == 1 and c.write_errors == 1 and c.hits == 1 and not pool.reachable
            assert len(caplog.records) == 1 and "read failed" in caplog.records[0].getMessage()
            server.start()  # same port, empty (no persistence)
            time.sleep(0.35)
            assert pool.get(b"k") is None and pool.reachable  # reconnected; the old value is gone
            assert pool.put(b"k", b"new") and pool.get(b"k") == b"new"
            assert c.backend_errors == 1
        finally:
            pool.close()


def test_a_server_that_never_answers_costs_one_short_timeout_per_back_off() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        pool = RedisSwaPool(url, namespace="ns", socket_timeout_s=0.2, backoff_s=30)
        t0 = time.monotonic()
        pool.open()  # PING times out (once, plus redis-py's one immediate retry)
        assert time.monotonic() - t0 < 1.5
        t1 = time.monotonic()
        assert [pool.get(b"k") for _ in range(50)] == [None] * 50  # skipped: backed off
        assert pool.put(b"k", b"v") is False
        assert time.monotonic() - t1 < 0.2
        assert pool.counters.backend_errors == 1 and pool.counters.lookups == 50
        pool.close()


def test_a_dead_shard_only_loses_its_keys(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "a") as a, RedisServer(tmp_path / "b") as b:
        pool = _pool(f"{a.url},{b.url}", "ns", backoff_s=60)
        other_order = _pool(f"{b.url}, {a.url}", "ns")
        try:
            keys = [b"key%d" % i for i in range(40)]
            for k in keys:
                assert pool.put(k, k * 100)
            on_a = {k for k in keys if redis.Redis(port=a.port).exists(f"kvdiet:swa:{{ns:{k.hex()}}}:m")}
            assert 5 < len(on_a) < 35  # rendezvous hashing spreads the keys over both
            assert other_order.get_many(keys) == [k * 100 for k in keys]  # any order of the same list
            b.stop()
            got = pool.get_many(keys)
            assert got == [k * 100 if k in on_a else None for k in keys]
            assert [pool.put(k, b"x") for k in keys[:10]] == [k in on_a for k in keys[:10]]
            assert pool.counters.backend_errors == 1  # one failure, then b is skipped
        finally:
            pool.close()
            other_order.close()


# --- Redis Cluster ---


def _start_cluster(tmp_path: Path) -> list[RedisServer]:
    """Three cluster-enabled masters on free ports, slots split three ways, met, state ok."""
    nodes = []
    for i in range(3):
        d = tmp_path / f"node{i}"
        opts = ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "n.conf")]
        nodes.append(RedisServer(d, port=cluster_port(), options=opts))
    try:
        for n in nodes:
            n.start()
        clients = [redis.Redis(port=n.port) for n in nodes]
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for c, (lo, hi) in zip(clients, bounds, strict=True):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for n in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        deadline = time.monotonic() + 20
        while not all(
            c.execute_command("CLUSTER", "INFO").decode().count("cluster_state:ok") for c in clients
        ):
            assert time.monotonic() < deadline, "cluster did not reach state ok"
            time.sleep(0.1)
        for c in clients:
            c.close()
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


def test_redis_cluster_backend(tmp_path: Path) -> None:
    nodes = _start_cluster(tmp_path)
    try:
        pool = _pool(f"redis+cluster://127.0.0.1:{nodes[0].port}", "ns", chunk_bytes=1000)
        values = {b"k%d" % i: random.Random(i).randbytes(2500 + i) for i in range(30)}
        for k, v in values.items():
            assert pool.put(k, v)
        assert pool.get_many([*values, b"absent"]) == [*values.values(), None]
        holders = [redis.Redis(port=n.port).dbsize() for n in nodes]
        assert sum(holders) == 30 * 4 and sum(h > 0 for h in holders) >= 2  # slots spread over the nodes
        assert pool.put(b"k0", b"short") and pool.get(b"k0") == b"short"  # overwrite in one slot
        assert len(pool) == 29 * 4 + 2 and pool.nbytes > 0
        tag = f"kvdiet:swa:{{ns:{b'k5'.hex()}}}"
        node = next(redis.Redis(port=n.port) for n in nodes if redis.Redis(port=n.port).exists(f"{tag}:m"))
        node.delete(f"{tag}:{MANIFEST.unpack(node.get(f'{tag}:m'))[3].hex()}:1")
        assert pool.get(b"k5") is None and node.exists(f"{tag}:m") == 0  # the drop script ran in the slot
        c = pool.counters
        assert (c.corrupt_dropped, c.evictions, c.backend_errors) == (0, 1, 0)
        pool.close()
    finally:
        for n in nodes:
            n.stop()
