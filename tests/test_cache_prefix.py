"""Chained block hashes and the model fingerprint: stable across processes, chained, domain-separated."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from kvdiet.cache.prefix import ROOT_HASH, block_hashes, chain_hash, model_fingerprint

FP = model_fingerprint({"model": "test", "block_size": 4})
TOKENS = list(range(100, 118))  # 4 full blocks of 4 and 2 tokens left over

_CHILD = (
    "import json; from kvdiet.cache.prefix import block_hashes, chain_hash, model_fingerprint, ROOT_HASH;"
    "fp = model_fingerprint({'model': 'test', 'block_size': 4});"
    "print(json.dumps({"
    "'fp': fp.hex(),"
    "'root': ROOT_HASH.hex(),"
    "'blocks': [h.hex() for h in block_hashes(list(range(100, 118)), 4, fp)],"
    "'salted': [h.hex() for h in block_hashes(list(range(100, 118)), 4, fp, b'tenant')],"
    "'one': chain_hash(ROOT_HASH, [1, 2], b'', None).hex(),"
    "'fields': model_fingerprint({'b': [1, 2], 'a': {'y': 1, 'x': 2}}).hex()}))"
)


def _in_process() -> dict:
    return {
        "fp": FP.hex(),
        "root": ROOT_HASH.hex(),
        "blocks": [h.hex() for h in block_hashes(TOKENS, 4, FP)],
        "salted": [h.hex() for h in block_hashes(TOKENS, 4, FP, b"tenant")],
        "one": chain_hash(ROOT_HASH, [1, 2], b"", None).hex(),
        "fields": model_fingerprint({"b": [1, 2], "a": {"y": 1, "x": 2}}).hex(),
    }


@pytest.mark.parametrize("seed", ["0", "1", "12345", "random"])
def test_same_hashes_in_another_process(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    child = json.loads(out.stdout)
    assert child == _in_process()
    assert len(child["blocks"]) == 4 and len(set(child["blocks"])) == 4


def test_root_and_sizes() -> None:
    assert hashlib.blake2b(b"kvdiet prefix root v1", digest_size=32).digest() == ROOT_HASH
    assert len(FP) == 32
    assert all(len(h) == 32 for h in block_hashes(TOKENS, 4, FP))


def test_chain_hash_known_encoding() -> None:
    """The documented encoding: tagged, length-prefixed fields under a fixed personalization."""
    h = hashlib.blake2b(digest_size=32, person=b"kvdiet-block-v1")
    payload_t = struct.pack("<3I", 7, 8, 9)
    for tag, payload in [(b"P", ROOT_HASH), (b"T", payload_t), (b"F", FP), (b"S", b"\x01ab")]:
        h.update(tag + struct.pack("<Q", len(payload)) + payload)
    assert chain_hash(ROOT_HASH, [7, 8, 9], FP, b"ab") == h.digest()


def test_block_hashes_are_chained() -> None:
    hs = block_hashes(TOKENS, 4, FP)
    parent = ROOT_HASH
    for i, h in enumerate(hs):
        assert h == chain_hash(parent, TOKENS[4 * i : 4 * i + 4], FP)
        parent = h


def test_changing_block_zero_changes_every_hash() -> None:
    base = block_hashes(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[1] += 1
    other = block_hashes(changed, 4, FP)
    assert all(a != b for a, b in zip(base, other, strict=True))
    # Later blocks are identical token for token, yet their hashes differ through the chain.
    assert changed[4:] == TOKENS[4:]


def test_changing_block_two_keeps_earlier_hashes() -> None:
    base = block_hashes(TOKENS, 4, FP)
    changed = list(TOKENS)
    changed[9] = 0  # block 2 covers tokens 8..11
    other = block_hashes(changed, 4, FP)
    assert other[:2] == base[:2]
    assert other[2] != base[2] and other[3] != base[3]


def test_same_block_at_another_position_differs() -> None:
    block = [5, 6, 7, 8]
    hs = block_hashes(block * 3, 4, FP)
    assert len(set(hs)) == 3


def test_only_full_blocks() -> None:
    assert len(block_hashes(TOKENS, 4, FP)) == 4
    assert block_hashes(TOKENS, 4, FP) == block_hashes(TOKENS[:16], 4, FP)
    assert block_hashes(TOKENS[:15], 4, FP) == block_hashes(TOKENS, 4, FP)[:3]
    assert block_hashes(TOKENS[:3], 4, FP) == []
    assert block_hashes([], 4, FP) == []
    assert len(block_hashes(TOKENS, 18, FP)) == 1
    assert len(block_hashes(TOKENS, 19, FP)) == 0
    assert len(block_hashes(TOKENS, 1, FP)) == 18


def test_block_size_changes_hashes() -> None:
    # The first 8 tokens as one block of 8 vs two blocks of 4: no hash in common.
    assert not set(block_hashes(TOKENS[:8], 8, FP)) & set(block_hashes(TOKENS[:8], 4, FP))


def test_fingerprint_and_salt_change_the_hash() -> None:
    fp2 = model_fingerprint({"model": "test", "block_size": 8})
    variants = {
        "base": block_hashes(TOKENS, 4, FP),
        "fp": block_hashes(TOKENS, 4, fp2),
        "none": block_hashes(TOKENS, 4, FP, None),
        "empty": block_hashes(TOKENS, 4, FP, b""),
        "a": block_hashes(TOKENS, 4, FP, b"a"),
        "b": block_hashes(TOKENS, 4, FP, b"b"),
        "zero": block_hashes(TOKENS, 4, FP, b"\x00"),
    }
    assert variants["base"] == variants["none"]  # the default salt is None
    del variants["none"]
    firsts = [v[0] for v in variants.values()]
    assert len(set(firsts)) == len(firsts)
    every = [h for v in variants.values() for h in v]
    assert len(set(every)) == len(every)


def test_domain_separation() -> None:
    """Field lists that naive concatenation would encode to the same bytes hash differently."""

    def naive(parent: bytes, tokens: list[int], fp: bytes, salt: bytes | None) -> bytes:
        body = struct.pack(f"<{len(tokens)}I", *tokens) + fp + (salt or b"")
        return hashlib.blake2b(parent + body, digest_size=32).digest()

    two = struct.pack("<I", 2)
    cases = [
        # A token moved into the fingerprint.
        ((ROOT_HASH, [1, 2], b"", b""), (ROOT_HASH, [1], two, b"")),
        # Fingerprint bytes moved into the salt.
        ((ROOT_HASH, [1, 2], b"ab", b""), (ROOT_HASH, [1, 2], b"a", b"b")),
        # Salt None vs b"" (naively both empty).
        ((ROOT_HASH, [1, 2], b"", None), (ROOT_HASH, [1, 2], b"", b"")),
        # Bytes of the parent moved into the tokens.
        ((ROOT_HASH + two, [3], b"", None), (ROOT_HASH, [2, 3], b"", None)),
        # The whole token block moved into the fingerprint.
        ((ROOT_HASH, [1, 2], b"", None), (ROOT_HASH, [], struct.pack("<2I", 1, 2), None)),
    ]
    for a, b in cases:
        assert naive(*a) == naive(*b), "each case must collide under naive concatenation"
        assert chain_hash(*a) != chain_hash(*b), (a, b)


def test_tokens_out_of_range_are_rejected() -> None:
    with pytest.raises(struct.error):
        chain_hash(ROOT_HASH, [2**32], FP)
    with pytest.raises(struct.error):
        chain_hash(ROOT_HASH, [-1], FP)
    assert chain_hash(ROOT_HASH, [2**32 - 1], FP) != chain_hash(ROOT_HASH, [0], FP)


BASE_FIELDS = {
    "config": {"sliding_window": 128, "compress_ratios": [0, 4, 128], "hidden_size": 4096},
    "weights": "sha256:abc",
    "tokenizer": "deepseek-v4",
    "formats": ["fp8-e4m3", "mxfp4"],
    "block_size": 64,
}


def _variants() -> list[tuple[str, dict]]:
    out = []
    for key, value in [
        ("weights", "sha256:abd"),
        ("tokenizer", "deepseek-v3"),
        ("formats", ["fp8-e4m3", "fp4"]),
        ("formats", ["mxfp4", "fp8-e4m3"]),  # order of formats matters
        ("block_size", 128),
        ("block_size", "64"),  # type matters
        ("extra", None),  # an added field
    ]:
        out.append((f"{key}={value!r}", {**BASE_FIELDS, key: value}))
    for key, value in [("sliding_window", 127), ("compress_ratios", [0, 4, 64]), ("hidden_size", 4097)]:
        out.append((f"config.{key}", {**BASE_FIELDS, "config": {**BASE_FIELDS["config"], key: value}}))
    removed = dict(BASE_FIELDS)
    del removed["tokenizer"]
    out.append(("no tokenizer", removed))
    return out


def test_fingerprint_changes_with_every_field() -> None:
    base = model_fingerprint(BASE_FIELDS)
    prints = {name: model_fingerprint(fields) for name, fields in _variants()}
    for name, fp in prints.items():
        assert fp != base, name
    assert len(set(prints.values())) == len(prints)


def test_fingerprint_ignores_key_order() -> None:
    reordered = {k: BASE_FIELDS[k] for k in reversed(list(BASE_FIELDS))}
    reordered["config"] = {k: BASE_FIELDS["config"][k] for k in reversed(list(BASE_FIELDS["config"]))}
    assert list(reordered) != list(BASE_FIELDS)
    assert model_fingerprint(reordered) == model_fingerprint(BASE_FIELDS)
    assert model_fingerprint(BASE_FIELDS) == model_fingerprint(json.loads(json.dumps(BASE_FIELDS)))


def test_fingerprint_of_non_json_values_uses_str() -> None:
    class Named:
        def __str__(self) -> str:
            return "named-v1"

    assert model_fingerprint({"weights": Named()}) == model_fingerprint({"weights": "named-v1"})
    assert model_fingerprint({"weights": Named()}) != model_fingerprint({"weights": "named-v2"})
