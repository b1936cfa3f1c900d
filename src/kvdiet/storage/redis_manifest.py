"""The manifest of one value in the Redis SWA pool (36 B, little-endian; layout in `kvdiet.storage.redis_pool`):
magic ``b"KVRS"`` · version u16 · flags u16 · nonce (8 B) · chunk count u32 · total length u64 · CRC-32 of
the value u32 · CRC-32 of the 32 bytes before it u32. `pack_manifest` / `parse_manifest` and nothing else.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["MAGIC", "MANIFEST", "VERSION", "Manifest", "pack_manifest", "parse_manifest"]

MAGIC = b"KVRS"
VERSION = 1
MANIFEST = struct.Struct("<4sHH8sIQII")  # magic, version, flags, nonce, chunks, total length, CRC, head CRC
_MAX_CHUNKS = 1 << 20  # a manifest claiming more is corrupt (1 TiB at the default chunk size)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A manifest that passed its checks: its bytes, the nonce of its chunk keys (hex), the chunk count, the
    value's length in bytes and the value's CRC-32."""

    raw: bytes
    nonce: str  # hex
    chunks: int
    total: int
    crc: int


def pack_manifest(nonce: bytes, chunks: int, total: int, crc: int) -> bytes:
    head = MANIFEST.pack(MAGIC, VERSION, 0, nonce, chunks, total, crc, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def parse_manifest(raw: bytes) -> Manifest | None:
    """The manifest in ``raw``, or None when it fails any check (length, magic, version, flags, its CRC,
    a chunk count that cannot hold the length)."""
    if len(raw) != MANIFEST.size:
        return None
    magic, version, flags, nonce, chunks, total, crc, head_crc = MANIFEST.unpack(raw)
    if (magic, version, flags) != (MAGIC, VERSION, 0) or zlib.crc32(raw[:-4]) != head_crc:
        return None
    if chunks > _MAX_CHUNKS or (total == 0) != (chunks == 0) or chunks > total:
        return None
    return Manifest(bytes(raw), nonce.hex(), chunks, total, crc)
