"""Chained block hashes of a prompt, and the model fingerprint they are bound to.

``hash(block i) = BLAKE2b-256(parent = hash(block i−1) or ROOT, the block's token ids, fingerprint, salt)``
with each field tagged and length-prefixed (domain separation: no two field lists encode to the same
bytes). The root is a fixed constant, not a per-process random seed, so hashes agree across processes and
restarts (the persistent tier relies on it). Only full blocks get a hash. A hit is confirmed against the
stored token ids by the tier that holds the block, so a hash collision is a miss, never wrong KV.

The fingerprint covers everything that changes cached bytes (case B21): the config fields, the weights'
checksum, the tokenizer, the cache format names and the block size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence

__all__ = ["ROOT_HASH", "block_hashes", "chain_hash", "model_fingerprint"]

ROOT_HASH = hashlib.blake2b(b"kvdiet prefix root v1", digest_size=32).digest()
"""Parent of a prompt's first block (fixed across processes and restarts)."""

_PERSON = b"kvdiet-block-v1"


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def chain_hash(parent: bytes, tokens: Sequence[int], fingerprint: bytes, salt: bytes | None = None) -> bytes:
    """32-byte hash of one full block given its parent's hash.

    Args:
        parent: the previous block's hash, or `ROOT_HASH`.
        tokens: the block's token ids (each in [0, 2³²)).
        fingerprint: `model_fingerprint` of the model that produced the KV.
        salt: optional cache salt (tenant isolation); None and ``b""`` differ.
    """
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    h.update(_field(b"P", parent))
    h.update(_field(b"T", struct.pack(f"<{len(tokens)}I", *tokens)))
    h.update(_field(b"F", fingerprint))
    h.update(_field(b"S", b"\x00" if salt is None else b"\x01" + salt))
    return h.digest()


def block_hashes(
    tokens: Sequence[int], block_size: int, fingerprint: bytes, salt: bytes | None = None
) -> list[bytes]:
    """Hashes of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them), chained from the root."""
    out, parent = [], ROOT_HASH
    for s in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[s : s + block_size], fingerprint, salt)
        out.append(parent)
    return out


def model_fingerprint(fields: Mapping[str, object]) -> bytes:
    """32-byte digest of a model's cache identity: canonical JSON of ``fields`` (sorted keys).

    Callers pass at least the config (as its JSON fields), ``weights`` (a checksum of the parameters),
    ``tokenizer`` (its identity), ``formats`` (cache format names) and ``block_size``.
    """
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=32, person=b"kvdiet-model-v1").digest()
