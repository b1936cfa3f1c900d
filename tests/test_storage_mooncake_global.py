"""MooncakeGlobalPool against a real mooncake_master: blocks of global KV as checked entries (the block's
identity and token ids), the TTL in the Mooncake header, damaged and foreign values as counted misses that are
removed, and a master that is down (misses and refused writes, never an exception)."""

from __future__ import annotations

import logging
import random
import struct
import time
import uuid
import zlib

import pytest

from kvdiet.cli import main
from kvdiet.storage.clock import ManualClock
from kvdiet.storage.entry import EntryCodec, StoreIdentity
from kvdiet.storage.mooncake_global import MooncakeGlobalPool
from kvdiet.storage.mooncake_header import HEADER, pack_header
from mooncake_helpers import MooncakeMaster, master_with_segment, raw_client_of
from redis_helpers import free_port

LOGGER = "kvdiet.storage.mooncake_pool"
BS = 4


master = pytest.fixture(scope="module")(master_with_segment)
raw = pytest.fixture(scope="module")(raw_client_of)


@pytest.fixture
def ident() -> StoreIdentity:
    return StoreIdentity(uuid.uuid4().hex, ("fp4_e2m1_e4m3x16", "mxfp4"), BS)


def _pool(url: str, identity: StoreIdentity, **kw) -> MooncakeGlobalPool:
    pool = MooncakeGlobalPool(url, identity=identity, segment_bytes=kw.pop("segment_bytes", 0), **kw)
    pool.open()
    return pool


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _name(identity: StoreIdentity, key: bytes) -> str:
    return f"kvdiet:kv:{identity.fingerprint}:{key.hex()}"


PAYLOAD = random.Random(5).randbytes(3000)
TOKENS = [11, 12, 13, 14]


def test_round_trip_counters_and_value_layout(master: MooncakeMaster, ident: StoreIdentity, raw) -> None:
    clock = ManualClock(2_000.0)
    pool = _pool(master.url, ident, ttl_s=60, clock=clock)
    try:
        other = [21, 22, 23, 24]
        assert pool.put_many([(_key(1), TOKENS, PAYLOAD), (_key(2), other, PAYLOAD[:100])]) == 2
        assert pool.contains_prefix([_key(1), _key(2), _key(3), _key(1)]) == 2
        assert pool.get_many([_key(1), _key(3), _key(2)], [TOKENS, TOKENS, other]) == [
            PAYLOAD,
            None,
            PAYLOAD[:100],
        ]
        c = pool.counters
        assert (c.lookups, c.hits, c.entries_written, c.corrupt_dropped) == (3, 2, 2, 0)
        stored = raw.get(_name(ident, _key(1)))
        entry = stored[HEADER.size :]
        assert c.bytes_written == len(entry) + len(raw.get(_name(ident, _key(2)))) - HEADER.size
        magic, _, _, deadline, length, crc, _ = HEADER.unpack_from(stored)
        assert (magic, deadline, length, crc) == (b"KVMC", 2_060.0, len(entry), zlib.crc32(entry))
        assert EntryCodec(ident).unpack(entry, _key(1), TOKENS) == ("ok", PAYLOAD)  # a persistent entry
        assert entry.startswith(b"KVDB") and b'"tokens":[11,12,13,14]' in entry
    finally:
        pool.close()


def test_other_token_ids_are_a_hash_collision_a_miss_counted_and_removed(
    master: MooncakeMaster, ident: StoreIdentity, raw
) -> None:
    pool = _pool(master.url, ident)
    try:
        assert pool.put_many([(_key(1), TOKENS, PAYLOAD)]) == 1
        assert pool.get_many([_key(1)], [[11, 12, 13, 15]]) == [None]
        assert pool.counters.corrupt_dropped == 1 and pool.counters.hits == 0
        assert raw.is_exist(_name(ident, _key(1))) == 0
        assert pool.get_many([_key(1)], [TOKENS]) == [None] and pool.counters.corrupt_dropped == 1
    finally:
        pool.close()


@pytest.mark.parametrize(
    "foreign",
    [
        lambda i: StoreIdentity(i.fingerprint, ("fp8_e4m3",), i.block_size),
        lambda i: StoreIdentity(i.fingerprint, i.formats, 8),
    ],
    ids=["other formats", "other block size"],
)
def test_a_value_of_another_identity_is_never_a_hit(
    master: MooncakeMaster, ident: StoreIdentity, raw, foreign
) -> None:
    theirs = foreign(
        ident
    )  # same fingerprint: the same key names, so only the entry's header tells them apart
    writer, reader = _pool(master.url, theirs), _pool(master.url, ident)
    try:
        tokens = list(range(theirs.block_size))
        assert writer.put_many([(_key(7), tokens, PAYLOAD)]) == 1
        assert raw.is_exist(_name(ident, _key(7))) == 1
        assert reader.get_many([_key(7)], [tokens[:BS]]) == [None]
        assert reader.counters.corrupt_dropped == 1 and raw.is_exist(_name(ident, _key(7))) == 0
    finally:
        writer.close()
        reader.close()


def test_another_model_sees_nothing(master: MooncakeMaster, ident: StoreIdentity) -> None:
    other = StoreIdentity(uuid.uuid4().hex, ident.formats, BS)
    mine, theirs = _pool(master.url, ident), _pool(master.url, other)
    try:
        assert mine.put_many([(_key(1), TOKENS, PAYLOAD)]) == 1
        assert theirs.contains_prefix([_key(1)]) == 0 and theirs.get_many([_key(1)], [TOKENS]) == [None]
        assert theirs.counters.corrupt_dropped == 0 and mine.get_many([_key(1)], [TOKENS]) == [PAYLOAD]
    finally:
        mine.close()
        theirs.close()


def _reheader(value: bytes, entry: bytes) -> bytes:
    """``entry`` behind ``value``'s Mooncake header with a length and CRC that fit it (only the entry's own
    checks can catch the damage)."""
    deadline = struct.unpack_from("<d", value, 8)[0]
    return pack_header(deadline, len(entry), zlib.crc32(entry)) + entry


DAMAGE = {
    "outer payload byte flipped": lambda v: v[:60] + bytes([v[60] ^ 1]) + v[61:],
    "entry payload byte flipped": lambda v: _reheader(v, v[32:-50] + bytes([v[-50] ^ 1]) + v[-49:]),
    "entry truncated": lambda v: _reheader(v, v[32:-1]),
    "entry header rewritten": lambda v: _reheader(v, v[32:].replace(b'"tokens":[11', b'"tokens":[10')),
    "no entry at all": lambda v: _reheader(v, b"raw bytes, no entry"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_value_is_a_miss_counted_and_removed(
    master: MooncakeMaster, ident: StoreIdentity, raw, damage
) -> None:
    pool = _pool(master.url, ident)
    try:
        other = [1, 2, 3, 4]
        assert pool.put_many([(_key(1), TOKENS, PAYLOAD), (_key(2), other, b"kept")]) == 2
        name = _name(ident, _key(1))
        assert raw.upsert(name, DAMAGE[damage](raw.get(name))) == 0
        assert pool.get_many([_key(2), _key(1)], [other, TOKENS]) == [b"kept", None]
        c = pool.counters
        assert (c.corrupt_dropped, c.hits, c.evictions, c.expirations) == (1, 1, 0, 0)
        assert raw.is_exist(name) == 0
    finally:
        pool.close()


def test_expired_blocks_are_misses_and_removed(master: MooncakeMaster, ident: StoreIdentity, raw) -> None:
    clock = ManualClock(100.0)
    pool = _pool(master.url, ident, ttl_s=5, clock=clock)
    try:
        assert pool.put_many([(_key(1), TOKENS, PAYLOAD)]) == 1
        clock.set(104.9)
        assert pool.get_many([_key(1)], [TOKENS]) == [PAYLOAD]
        clock.set(105.0)
        assert pool.get_many([_key(1)], [TOKENS]) == [None]
        assert pool.counters.expirations == 1 and raw.is_exist(_name(ident, _key(1))) == 0
    finally:
        pool.close()


def test_bad_input_is_refused_before_anything_is_written(
    master: MooncakeMaster, ident: StoreIdentity
) -> None:
    pool = _pool(master.url, ident)
    try:
        with pytest.raises(ValueError, match="need 4 token ids"):
            pool.put_many([(_key(1), TOKENS, PAYLOAD), (_key(2), [1, 2], PAYLOAD)])
        with pytest.raises(ValueError, match="--global-pool: a read needs the token ids"):
            pool.get_many([_key(1)])
        with pytest.raises(ValueError, match="key must be 32 bytes"):
            pool.get_many([b"short"], [TOKENS])
        assert pool.contains_prefix([_key(1)]) == 0 and pool.counters.entries_written == 0
    finally:
        pool.close()
    with pytest.raises(ValueError, match="--global-pool: port 0"):
        MooncakeGlobalPool("mooncake://127.0.0.1:0", identity=ident)
    with pytest.raises(ValueError, match="--global-pool: TTL"):
        MooncakeGlobalPool("mooncake://127.0.0.1", identity=ident, ttl_s=0)


def test_master_down_misses_and_refused_writes_never_raise(ident: StoreIdentity, caplog) -> None:
    pool = MooncakeGlobalPool(f"mooncake://127.0.0.1:{free_port()}", identity=ident, segment_bytes=0)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        t0 = time.monotonic()
        pool.open()
        assert pool.put_many([(_key(1), TOKENS, PAYLOAD), (_key(2), TOKENS, PAYLOAD)]) == 0
        assert pool.get_many([_key(1)], [TOKENS]) == [None] and pool.contains_prefix([_key(1)]) == 0
        assert time.monotonic() - t0 < 1.0
    c = pool.counters
    assert (c.backend_errors, c.write_errors, c.lookups, c.hits) == (1, 2, 1, 0) and not pool.reachable
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("global pool mooncake://127.0.0.1:")
    assert "persistent tier or are computed" in warnings[0]
    pool.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--global-pool", "mooncake://127.0.0.1:0"], "--global-pool: port 0"),
        (
            ["--global-pool", "redis://127.0.0.1:6379/0"],
            "--global-pool: 'redis://127.0.0.1:6379/0' is not a Mooncake",
        ),
        (
            ["--global-pool", "mooncake://h:1", "--global-pool-size", "lots"],
            "--global-pool-size: cannot parse",
        ),
        (
            ["--global-pool", "mooncake://h:1", "--global-pool-ttl", "0s"],
            "--global-pool-ttl: duration must be > 0",
        ),
        (["--global-pool-size", "64MiB"], "--global-pool-size: no --global-pool is given"),
        (["--global-pool-ttl", "10m"], "--global-pool-ttl: no --global-pool is given"),
    ],
)
def test_cli_refuses_bad_global_pool_flags_with_exit_2(capsys, flags: list[str], message: str) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiet generate: error: {message}") and err.count("\n") == 1
