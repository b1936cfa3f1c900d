"""A request's window (SWA) state at one position, as raw bytes: what the SWA pool and snapshot policies keep.

A snapshot at position H holds everything besides the global KV that the next token needs: every layer's
window ring (the packed FP8 entries of positions ``[H−W, H)`` and their positions), every compressor tail
(the fp32 rows of an open group; empty at a block boundary) and the Engram history. Restoring it gives the
exact state the request had at H (v41-spec §7.2; case B08: nothing older than H−W is kept).

Byte layout (little-endian): ``MAGIC`` (8 B) · header length (u32) · header (UTF-8 JSON: fingerprint,
num_tokens, layer count, window, ring width and dtype, tail shapes, history length) · ring rows · ring
positions (int64) · per tail: count (u32), rows held n (u32), kv and score of rows ``[0, n)`` (the tail's
dtype) · history (int64) · CRC-32 of everything before it (u32). A tail's rows past n are empty (zero kv,
−inf scores) and are not written: a V4.1 tail holds its ``count`` open rows, a V4-Flash HCA tail its open
rows of up to 127 (none at a multiple of 128), a CSA tail the last complete window and its open rows.
Never pickle. Any mismatch on read is `SnapshotError`.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import torch

from kvdiet.device import to_host
from kvdiet.model.state import RequestState

__all__ = ["MAGIC", "SnapshotError", "restore_snapshot", "snapshot_bytes"]

MAGIC = b"KVDSWA02"  # 02: tails hold only their non-empty rows


class SnapshotError(ValueError):
    """A snapshot is truncated, corrupt, or from another model or geometry."""


def _np(t: torch.Tensor) -> bytes:
    return to_host(t).numpy().tobytes()  # a snapshot's tensors cross to the host here


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


def _rows_held(score: torch.Tensor) -> int:
    """Rows ``[0, n)`` of a tail that hold anything: after the last row with a finite score, all are empty."""
    finite = torch.isfinite(score).any(dim=1).nonzero()
    return int(finite[-1]) + 1 if finite.numel() else 0


def snapshot_bytes(state: RequestState, fingerprint: bytes) -> bytes:
    """Serialize ``state``'s window rings, compressor tails and Engram history at ``state.num_tokens``."""
    rings = state.windows
    header = _geometry(state, fingerprint) | {"num_tokens": state.num_tokens}
    head = json.dumps(header, sort_keys=True).encode()
    parts = [MAGIC, struct.pack("<I", len(head)), head]
    parts += [_np(r.rows) for r in rings] + [_np(r.positions) for r in rings]
    for _, tail in sorted(state.tails.items()):
        n = _rows_held(tail.score)
        parts += [struct.pack("<II", tail.count, n), _np(tail.kv[:n]), _np(tail.score[:n])]
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
    ratios = state.table.pool.ratios  # each layer must hold every entry completed by token h
    if not 0 <= h <= state.num_tokens or any(len(e) < h // ratios[k] for k, e in state.main.items()):
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
        count, n = struct.unpack_from("<II", take(8, np.dtype("u1"), (8,)).numpy().tobytes())
        size, width = tail.kv.shape
        if count >= size or n > size:
            raise SnapshotError(f"compressor tail holds {count} open of {n} rows, its size is {size}")
        dtype = np.dtype(str(tail.kv.dtype).removeprefix("torch.")).newbyteorder("<")
        nbytes = tail.kv.element_size() * n * width
        kv, score = take(nbytes, dtype, (n, width)), take(nbytes, dtype, (n, width))
        tails.append((count, kv, score))
    history = take(8 * state.engram_history.numel(), np.dtype("<i8"), (state.engram_history.numel(),))
    if at != len(body):
        raise SnapshotError(f"window snapshot has {len(body) - at} trailing bytes")
    # validated: now mutate
    for ring, r, p in zip(rings, rows, positions, strict=True):
        ring.rows.copy_(r)
        ring.positions.copy_(p)
    for (_, tail), (count, kv, score) in zip(sorted(state.tails.items()), tails, strict=True):
        tail.kv.zero_()
        tail.score.fill_(float("-inf"))
        tail.kv[: kv.shape[0]], tail.score[: kv.shape[0]] = (
            kv,
            score,
        )  # V4 CSA: the last window, then open rows
        tail.count = count
    state.engram_history = history.to(state.engram_history.device)
    state.num_tokens = h
    return h
