"""A request's window (SWA) state at one position, as raw bytes: what the SWA pool and snapshot policies keep.

A snapshot at position H holds everything besides the global KV that the next token needs: every layer's
window ring (the packed FP8 entries of positions ``[H−W, H)`` and their positions), every compressor tail
(the fp32 rows of an open group; empty at a block boundary) and the Engram history. Restoring it gives the
exact state the request had at H (v41-spec §7.2; case B08: nothing older than H−W is kept).

Byte layout (little-endian): ``MAGIC`` (8 B) · header length (u32) · header (UTF-8 JSON: fingerprint,
num_tokens, layer count, window, ring width and dtype, tail shapes, history length) · ring rows · ring
positions (int64) · per tail: count (u32), kv and score (fp32) · history (int64) · CRC-32 of everything
before it (u32). Never pickle. Any mismatch on read is `SnapshotError`.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import torch

from kvdiet.model.state import RequestState

__all__ = ["MAGIC", "SnapshotError", "restore_snapshot", "snapshot_bytes"]

MAGIC = b"KVDSWA01"


class SnapshotError(ValueError):
    """A snapshot is truncated, corrupt, or from another model or geometry."""


def _np(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _geometry(state: RequestState, fingerprint: bytes) -> dict[str, object]:
    """The header fields a snapshot must share with the state it is restored into."""
    rings = state.windows
    return {
        "fingerprint": fingerprint.hex(),
        "layers": len(rings),
        "window": rings[0].window,
        "ring_width": rings[0].rows.shape[1],
        "ring_dtype": str(rings[0].rows.dtype),
        "tails": {str(k): list(t.kv.shape) for k, t in sorted(state.tails.items())},
        "history": int(state.engram_history.numel()),
    }


def snapshot_bytes(state: RequestState, fingerprint: bytes) -> bytes:
    """Serialize ``state``'s window rings, compressor tails and Engram history at ``state.num_tokens``."""
    rings = state.windows
    header = _geometry(state, fingerprint) | {"num_tokens": state.num_tokens}
    head = json.dumps(header, sort_keys=True).encode()
    parts = [MAGIC, struct.pack("<I", len(head)), head]
    parts += [_np(r.rows) for r in rings] + [_np(r.positions) for r in rings]
    for _, tail in sorted(state.tails.items()):
        parts += [struct.pack("<I", tail.count), _np(tail.kv), _np(tail.score)]
    parts.append(_np(state.engram_history.to(torch.int64)))
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def restore_snapshot(state: RequestState, data: bytes, fingerprint: bytes) -> int:
    """Load a snapshot into ``state`` (its rings, tails, history and ``num_tokens``); returns that position.

    Only ``state`` is touched (case B18). The state's global KV must already cover the snapshot's position.

    Raises:
        SnapshotError: truncated, checksum mismatch, another fingerprint or geometry, or a position past the
            state's global KV — checked before anything in ``state`` changes.
    """
    if len(data) < len(MAGIC) + 8 or data[: len(MAGIC)] != MAGIC:
        raise SnapshotError("not a kvdiet window snapshot (bad magic or too short)")
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise SnapshotError("window snapshot checksum mismatch")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    at = len(MAGIC) + 4
    try:
        header = json.loads(body[at : at + hlen])
    except ValueError as e:
        raise SnapshotError(f"window snapshot header unreadable: {e}") from None
    at += hlen
    rings = state.windows
    for key, value in _geometry(state, fingerprint).items():
        if header.get(key) != value:
            raise SnapshotError(
                f"window snapshot {key} {header.get(key)!r} does not match this model's {value!r}"
            )
    h = header["num_tokens"]
    held = min((len(e) * state.table.pool.ratios[k] for k, e in state.main.items()), default=h)
    if not 0 <= h <= state.num_tokens or h > held:
        raise SnapshotError(f"snapshot at {h} tokens but the request's global KV covers {state.num_tokens}")

    def take(n: int, dtype: np.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal at
        if at + n > len(body):
            raise SnapshotError("window snapshot truncated")
        out = torch.from_numpy(np.frombuffer(body, dtype=dtype, count=int(np.prod(shape)), offset=at).copy())
        at += n
        return out.view(shape)

    r0 = rings[0].rows
    ring_dtype = np.dtype(str(r0.dtype).removeprefix("torch."))
    rows = [take(r0.numel() * r0.element_size(), ring_dtype, tuple(r0.shape)) for _ in rings]
    positions = [take(8 * r0.shape[0], np.dtype("<i8"), (r0.shape[0],)) for _ in rings]
    tails = []
    for _, tail in sorted(state.tails.items()):
        (count,) = struct.unpack_from("<I", take(4, np.dtype("u1"), (4,)).numpy().tobytes())
        shape = tuple(tail.kv.shape)
        size, dtype = (
            tail.kv.element_size(),
            np.dtype(str(tail.kv.dtype).removeprefix("torch.")).newbyteorder("<"),
        )
        kv, score = (
            take(size * tail.kv.numel(), dtype, shape),
            take(size * tail.kv.numel(), dtype, shape),
        )
        if count >= shape[0]:
            raise SnapshotError(f"compressor tail holds {count} rows, a group has {shape[0]}")
        tails.append((count, kv, score))
    history = take(8 * state.engram_history.numel(), np.dtype("<i8"), (state.engram_history.numel(),))
    if at != len(body):
        raise SnapshotError(f"window snapshot has {len(body) - at} trailing bytes")
    # validated: now mutate
    for ring, r, p in zip(rings, rows, positions, strict=True):
        ring.rows.copy_(r)
        ring.positions.copy_(p)
    for (_, tail), (count, kv, score) in zip(sorted(state.tails.items()), tails, strict=True):
        tail.kv.copy_(
            kv
        )  # every row: V4-Flash's CSA tails carry the last complete window before the open rows
        tail.score.copy_(score)
        tail.count = count
    state.engram_history = history
    state.num_tokens = h
    return h
