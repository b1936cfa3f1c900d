"""Entry file layout: the header written equals json.dumps, and the byte-compare fast path agrees with
the parsed one."""

from __future__ import annotations

import json
import random

import pytest

from kvdiet.storage import entry
from kvdiet.storage.entry import FORMAT_VERSION, EntryCodec, StoreIdentity

IDENTITIES = [
    StoreIdentity(fingerprint="ab" * 32, formats=("fp4_e2m1_e4m3x16", "mxfp4"), block_size=4),
    StoreIdentity(fingerprint='fp "quoted" \\ ü 模型', formats=(), block_size=1),
    StoreIdentity(fingerprint="x", formats=("a\nb", "ü"), block_size=64),
]


def _json_head(identity: StoreIdentity, key: bytes, tokens: list[int], created: float, n: int) -> bytes:
    header = {
        "version": FORMAT_VERSION,
        "fingerprint": identity.fingerprint,
        "formats": list(identity.formats),
        "block_size": identity.block_size,
        "key": key.hex(),
        "tokens": tokens,
        "created": created,
        "payload_len": n,
    }
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _entry(codec: EntryCodec, key: bytes, tokens: list[int], created: float, payload: bytes) -> bytes:
    head, trailer = codec.pack(key, tokens, created, memoryview(payload))
    return head + payload + trailer


@pytest.mark.parametrize("identity", IDENTITIES)
@pytest.mark.parametrize("created", [0.0, -0.0, 0.1, 5.0, 1.7e9 + 0.123, 1e16, 1e-7, 2.5e300])
def test_header_is_the_json_dumps_header(identity: StoreIdentity, created: float) -> None:
    rng = random.Random(identity.block_size)
    key = rng.randbytes(32)
    tokens = [rng.randrange(1 << 40) for _ in range(identity.block_size)]
    head = EntryCodec(identity).pack_head(key, tokens, created, 123_456)
    assert head[10:] == _json_head(identity, key, tokens, created, 123_456)
    assert int.from_bytes(head[6:10], "little") == len(head) - 10


@pytest.mark.parametrize("identity", IDENTITIES)
def test_fast_and_parsed_checks_agree(identity: StoreIdentity) -> None:
    codec, rng = EntryCodec(identity), random.Random(7)
    key, payload = rng.randbytes(32), rng.randbytes(300)
    tokens = [rng.randrange(100_000) for _ in range(identity.block_size)]
    blob = _entry(codec, key, tokens, 12.5, payload)
    for created in (12.5, 13.0, None):  # header as written, another writer's time, no hint
        assert codec.unpack(blob, key, tokens, created=created) == ("ok", payload)
        other_tokens = [*tokens[:-1], tokens[-1] + 1]
        assert codec.unpack(blob, key, other_tokens, created=created) == ("corrupt", None)
        assert codec.unpack(blob, bytes(32), tokens, created=created) == ("corrupt", None)
    old = _json_head(identity, key, tokens, 12.5, len(payload))  # a header written by json.dumps
    assert old in blob
    other = StoreIdentity(fingerprint="zz", formats=identity.formats, block_size=identity.block_size)
    foreign = _entry(EntryCodec(other), key, tokens, 12.5, payload)
    assert codec.unpack(foreign, key, tokens, created=12.5) == ("foreign", None)
    for damaged in (blob[:-1], blob[:9], b"", blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:]):
        assert codec.unpack(damaged, key, tokens, created=12.5) == ("corrupt", None)


def test_check_item_rejects_bad_items() -> None:
    codec = EntryCodec(IDENTITIES[0])
    key, tokens = bytes(32), [1, 2, 3, 4]
    assert codec.check_item((bytearray(key), tuple(tokens), b"x")) == (key, tokens, memoryview(b"x"))
    for bad in [
        None,
        (key, tokens),
        (key[:31], tokens, b""),
        (key, [1, 2, 3], b""),
        (key, [1, 2, 3, -4], b""),
    ]:
        with pytest.raises(ValueError):
            codec.check_item(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        codec.check_item((key, tokens, memoryview(bytes(8))[::2]))


def test_header_as_written_is_compared_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    codec, key, tokens, payload = EntryCodec(IDENTITIES[0]), bytes(range(32)), [5, 6, 7, 8], b"kv" * 50
    blob = _entry(codec, key, tokens, 3.25, payload)

    def no_parse(text: str) -> object:
        raise AssertionError("parsed")

    monkeypatch.setattr(entry.json, "loads", no_parse)
    assert codec.unpack(blob, key, tokens, created=3.25) == ("ok", payload)
    with pytest.raises(AssertionError):
        codec.unpack(blob, key, tokens, created=3.5)
