"""The 32-byte header in front of every value of the Mooncake SWA pool (little-endian; the pool is
`kvdiet.storage.mooncake_pool`): magic ``b"KVMC"`` · version u16 · flags u16 · deadline f64 (wall-clock
seconds since the epoch: served while ``now < deadline``) · payload length u64 · CRC-32 of the payload u32 ·
CRC-32 of the 28 bytes before it u32. Then the payload, raw bytes (never pickle).

Mooncake Store has no per-key TTL (its ``--default_kv_lease_ttl`` is a read lease), so kvdiet keeps the TTL
itself, here. `pack_header` / `parse_header` and nothing else.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

__all__ = ["HEADER", "MAGIC", "VERSION", "Header", "pack_header", "parse_header"]

MAGIC = b"KVMC"
VERSION = 1
HEADER = struct.Struct("<4sHHdQII")  # magic, version, flags, deadline (s), payload length (B), CRC, head CRC


@dataclass(frozen=True, slots=True)
class Header:
    """A header that passed its checks: the deadline in wall-clock seconds, the payload's length in bytes and
    its CRC-32."""

    deadline: float
    length: int
    crc: int


def pack_header(deadline: float, length: int, crc: int) -> bytes:
    """The header of a payload of ``length`` bytes whose CRC-32 is ``crc``, served until ``deadline`` (s)."""
    head = HEADER.pack(MAGIC, VERSION, 0, deadline, length, crc, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def parse_header(raw: bytes | memoryview) -> Header | None:
    """The header at the start of ``raw`` (a whole value), or None when it fails a check: too short, magic,
    version, flags, its own CRC, a deadline that is not finite, or a length other than what follows it. The
    payload's CRC is the caller's to check (it needs the payload)."""
    if len(raw) < HEADER.size:
        return None
    magic, version, flags, deadline, length, crc, head_crc = HEADER.unpack_from(raw)
    if (magic, version, flags) != (MAGIC, VERSION, 0) or zlib.crc32(raw[: HEADER.size - 4]) != head_crc:
        return None
    if not math.isfinite(deadline) or length != len(raw) - HEADER.size:
        return None
    return Header(deadline, length, crc)
