"""Per-request cache state of the V4.1 model: packed global KV, window rings, compressor tails, Engram history.

What a request owns (v41-spec §2–§3, §8.3a):
- per KV-source (Full) layer: main-KV entries and index keys, appended as their groups complete, stored in
  place in the paged device pool through the request's `BlockTable` (`PagedEntries`; packed bytes unless
  the model runs unquantised). Reuse and Reindex layers own none.
- per layer: a ring of the last ``sliding_window`` window entries with their positions (`WindowRing`).
- per ratio>1 KV-source layer: the fp32 rows of the open compression group (`CompressorTail`).
- the last ``engram_max_ngram_size − 1`` compressed token ids (Engram history).

This module holds storage only; the model's layers decide what to write. Mutations happen through
``append``/``write``/``replace`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import overload

import torch

from kvdiet.formats.codec import Codec
from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.paged_pool import DevicePool

__all__ = [
    "BlockTable",
    "CacheBytes",
    "PagedEntries",
    "RequestState",
    "WindowRing",
    "WindowRings",
]

_LOG = attrgetter("log")  # a ring's log, read for 40 rings per request and step (no Python frame each)


class BlockTable:
    """A request's block ids in token order (block i covers tokens ``[i·block_size, (i+1)·block_size)``)."""

    def __init__(self, pool: DevicePool, ids: list[int] | None = None) -> None:
        self.pool = pool
        self.ids: list[int] = list(ids or [])
        self._tensor = torch.tensor(self.ids, dtype=torch.int64, device=pool.device)

    def __len__(self) -> int:
        return len(self.ids)

    def tensor(self) -> torch.Tensor:
        """int64 [len] on the pool's device (cached until the table grows: the ids cross to the device then)."""
        if self._tensor.numel() != len(self.ids):
            self._tensor = torch.tensor(self.ids, dtype=torch.int64, device=self.pool.device)
        return self._tensor

    def reserve(self, num_tokens: int) -> None:
        """Allocate blocks until ``num_tokens`` tokens fit. Raises `NoFreeBlocksError` (nothing allocated)."""
        need = -(-num_tokens // self.pool.block_size) - len(self.ids)
        if need > 0:
            self.ids.extend(self.pool.allocate(need))

    def release(self) -> None:
        """Return every block to the pool (tail first) and forget them; a second call does nothing."""
        ids, self.ids = self.ids, []
        self._tensor = self._tensor[:0]  # a table reserved again to the same length must not read the old ids
        if ids:
            self.pool.blocks.release(ids)


class PagedEntries:
    """One KV-source layer's main-KV entries or index keys of one request, read and written in place in the
    device pool through the request's block table (entry e → block ``e // entries_per_block``)."""

    def __init__(self, table: BlockTable, layer: int, kind: str, length: int = 0) -> None:
        self.table, self.layer, self.kind = table, layer, kind
        self.codec: Codec = table.pool.codecs[kind]
        self.per_block = table.pool.entries_per_block(layer)
        self._len = length

    def __len__(self) -> int:
        return self._len

    def slots(self, idx: torch.Tensor) -> torch.Tensor:
        """Pool rows (of ``pool.rows(layer, kind)``) of entry ids ``idx`` (int64, any shape, on the pool's device)."""
        return self.table.tensor()[idx // self.per_block] * self.per_block + idx % self.per_block

    def unheld(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of the consecutive entry ids ``ids`` int64 [M] this request does not hold yet (bool [M]).

        A replay recomputes entries below ``len`` and must not write them again (case B03); the first new one
        must be ``len``.

        Raises:
            ValueError: the first unheld id would leave a gap after the held entries.
        """
        new = ids >= self._len
        if bool(new.any()):
            self.is_next(int(ids[new][0]))
        return new

    def is_next(self, entry: int) -> bool:
        """Whether entry id ``entry`` is the next one to write (False: held already, a replay's).

        Raises:
            ValueError: ``entry`` would leave a gap after the held entries.
        """
        if entry > self._len:
            raise ValueError(f"layer {self.layer}: entry {entry} would leave a gap after {self._len}")
        return entry == self._len

    def append(self, values: torch.Tensor) -> None:
        """Encode and store fp32 ``values`` [M, dim] as entries ``len .. len+M−1`` (blocks must be reserved)."""
        self.write_rows(self.codec.encode(values))

    def write_rows(self, rows: torch.Tensor) -> None:
        """Store already-encoded ``rows`` [M, width] as entries ``len .. len+M−1`` (benchmarks fill this way;
        rows on another device are copied to the pool's).

        Raises:
            ValueError: wrong dtype/width, or the block table does not cover the new entries.
        """
        end = self._end(rows, rows.shape[0] if rows.dim() == 2 else 0)
        pages, rows = self.table.pool.rows(self.layer, self.kind), rows.to(self.table.pool.device)
        at = self._len
        while at < end:  # one slice per block the rows reach (one for a decode step's entry)
            block, first = divmod(at, self.per_block)
            n = min(self.per_block - first, end - at)
            slot = self.table.ids[block] * self.per_block + first
            pages[slot : slot + n] = rows[at - self._len : at - self._len + n]
            at += n
        self._len = end

    def _end(self, rows: torch.Tensor, count: int, *, checked: bool = False) -> int:
        """``len`` after storing ``count`` of ``rows`` (``checked``: their dtype and width are known to fit this
        store's codec); raises `write_rows`'s ValueError."""
        codec = self.codec
        if not checked and (rows.dim() != 2 or rows.shape[1] != codec.width or rows.dtype != codec.dtype):
            raise ValueError(
                f"rows must be {self.codec.dtype} [M, {self.codec.width}], got {rows.dtype} {tuple(rows.shape)}"
            )
        end = self._len + count
        if end > len(self.table) * self.per_block:
            raise ValueError(
                f"entries up to {end} need {-(-end // self.per_block)} blocks, table has {len(self.table)}"
            )
        return end

    @staticmethod
    def write_each(stores: Sequence[PagedEntries], rows: torch.Tensor) -> None:
        """Store encoded row m of ``rows`` [M, width] as the next entry of ``stores[m]`` (a batched decode step's,
        one per request): one copy when the stores share a pool, layer and kind, else `write_rows` each.

        Raises:
            ValueError: as `write_rows`, for any store, before anything is written; ``len(stores) != M``.
        """
        if len(stores) != rows.shape[0]:
            raise ValueError(f"{len(stores)} stores for {rows.shape[0]} rows")
        if len({(id(s.table.pool), s.layer, s.kind) for s in stores}) > 1:  # private pools: a copy each
            ends = [s._end(rows, 1) for s in stores]  # every store checked before any is written
            for m, s in enumerate(stores):
                s.write_rows(rows[m : m + 1])
        elif stores:  # one pool, layer and kind: one codec, whose dtype and width are checked once
            ends = [stores[0]._end(rows, 1)] + [s._end(rows, 1, checked=True) for s in stores[1:]]
            pages = stores[0].table.pool.rows(stores[0].layer, stores[0].kind)
            slots = [s.table.ids[s._len // s.per_block] * s.per_block + s._len % s.per_block for s in stores]
            pages.index_copy_(0, torch.tensor(slots, device=pages.device), rows.to(pages.device))
            for s, end in zip(stores, ends, strict=True):
                s._len = end

    def raw(self) -> torch.Tensor:
        """The stored rows [len, width] (a gathered copy)."""
        return self.raw_at(torch.arange(self._len, device=self.table.pool.device))

    def raw_at(self, idx: torch.Tensor) -> torch.Tensor:
        """The stored rows of entries ``idx`` (int64 [M], each in [0, len)) → [M, width] (a gathered copy)."""
        # index_select: advanced indexing of uint8 rows is ~40x slower on the CPU
        return self.table.pool.rows(self.layer, self.kind).index_select(0, self.slots(idx))

    def read(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded fp32 entries: all [len, dim], or ``idx`` (int64, any shape, each in [0, len)) → [..., dim]."""
        if idx is None:
            return self.codec.decode(self.raw())
        return self.codec.decode(self.raw_at(idx.flatten())).view(*idx.shape, self.codec.dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries written."""
        return self._len * self.codec.bytes_per_entry


class WindowRing:
    """The last ``window`` window entries of one layer, slot ``pos % window``, with their positions."""

    def __init__(
        self,
        codec: Codec,
        window: int,
        *,
        device: torch.device | str = "cpu",
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``storage``: the ``(rows [window, width], positions [window])`` to keep the ring in (a request's
        `WindowRings` passes views of its tensors; they are reset); new tensors on ``device`` when None."""
        self.codec = codec
        self.window = window
        if storage is None:
            storage = (
                torch.empty(window, codec.width, dtype=codec.dtype, device=device),
                torch.empty(window, dtype=torch.int64, device=device),
            )
        self.rows, self.positions = storage
        self.clear()
        self.log: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def write(self, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store fp32 ``values`` [M, dim] at increasing ``positions`` [M]; only the last ``window`` stay.

        While ``log`` is a list, every written row is also appended to it as ``(rows, positions)`` (the
        ``full-store`` policy keeps each token's window entries).
        """
        if self.log is None:
            values, positions = values[-self.window :], positions[-self.window :]
        self.store(self.codec.encode(values), positions)

    def store(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """`write` of already-encoded ``rows`` [M, width] (a batched decode step encodes every request's at once)."""
        if self.log is not None:
            self.log.append((rows, positions))
            rows, positions = rows[-self.window :], positions[-self.window :]
        slots = positions % self.window
        self.rows[slots] = rows
        self.positions[slots] = positions

    def clear(self) -> None:
        """Forget every entry (positions −1; rows zeroed)."""
        self.rows.zero_()
        self.positions.fill_(-1)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values fp32 [F, dim], positions int64 [F])`` of the F filled slots, in slot order."""
        filled = self.positions >= 0
        return self.codec.decode(self.rows[filled]), self.positions[filled]

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (allocated in full: it is fixed per request)."""
        return self.window * self.codec.bytes_per_entry


class WindowRings(Sequence[WindowRing]):
    """One request's window rings, one per layer, kept in two tensors: ring l is ``rows[l]`` [window, width]
    and ``positions[l]`` [window] (its `WindowRing` views them), so a decode step reads every layer's ring
    with one copy and stores every layer's new entry with one write (`store_step`).

    Args:
        codec: the window codec; window: entries per ring (config ``sliding_window``); layers: rings.
    """

    def __init__(self, codec: Codec, window: int, layers: int, *, device: torch.device | str = "cpu") -> None:
        self.rows = torch.empty(layers, window, codec.width, dtype=codec.dtype, device=device)
        self.positions = torch.empty(layers, window, dtype=torch.int64, device=device)
        # ring l: rows[l] [window, width] and positions[l] [window]; layer_rows keeps the views (read every step)
        views = zip(self.rows, self.positions, strict=True)
        self._rings = [WindowRing(codec, window, storage=pair) for pair in views]
        self.layer_rows = tuple(ring.rows for ring in self._rings)

    @overload
    def __getitem__(self, i: int) -> WindowRing: ...
    @overload
    def __getitem__(self, i: slice) -> list[WindowRing]: ...
    def __getitem__(self, i: int | slice) -> WindowRing | list[WindowRing]:
        return self._rings[i]

    def __len__(self) -> int:
        return len(self._rings)

    def store_step(self, rows: torch.Tensor, position: int) -> None:
        """Every ring's `WindowRing.store` of one entry, ``rows`` [layers, width] at ``position`` (logged in order)."""
        if self._logged():
            at = torch.tensor([position], device=self.positions.device)
            for i, ring in enumerate(self._rings):
                ring.store(rows[i : i + 1].clone(), at)
            return
        slot = position % self.rows.shape[1]
        self.rows[:, slot] = rows
        self.positions[:, slot] = position

    def _logged(self) -> bool:
        """Whether a ring logs its writes (``log`` not None; an empty list logs)."""
        return list(map(_LOG, self._rings)).count(None) != len(self._rings)

    @staticmethod
    def store_steps(rings: Sequence[WindowRings], rows: torch.Tensor, positions: Sequence[int]) -> None:
        """``rings[b].store_step(rows[:, b], positions[b])`` for every b (a batched decode step's new entries,
        ``rows`` [layers, B, width]): the same copies, the rows of rings that do not log in one call.

        Raises:
            ValueError: ``len(rings)``, ``len(positions)`` and B differ, or rows unlike a ring's (before any change).
        """
        if not len(rings) == len(positions) == rows.shape[1]:
            raise ValueError(f"{len(rings)} rings and {len(positions)} positions for {rows.shape[1]} rows")
        shape = (rows.shape[0], rows.shape[2], rows.dtype)
        if any(shape != (*r.rows.shape[::2], r.rows.dtype) for r in rings):
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} do not fit a ring's [layers, W, width]")
        dst_rows, src_rows, dst_pos = [], [], []
        for r, row, p in zip(rings, rows.unbind(1), positions, strict=True):
            if r._logged():
                r.store_step(row, p)
                continue
            slot = p % r.rows.shape[1]
            dst_rows.append(r.rows.select(1, slot))  # ``rows[:, slot]`` without the index parsing
            src_rows.append(row)
            dst_pos.append((r.positions.select(1, slot), p))
        if dst_rows:
            torch._foreach_copy_(dst_rows, src_rows)
        for at, p in dst_pos:
            at.fill_(p)


@dataclass(frozen=True, slots=True)
class CacheBytes:
    """Measured bytes of one request's caches.

    Attributes:
        num_tokens: tokens processed.
        global_bytes: main-KV + index-key rows written (grows with the context).
        window_bytes: all window rings (fixed per request).
        tail_bytes: compressor tails (fixed per request).
        per_layer: ``{layer: (main bytes, index-key bytes)}``.
        covered_tokens: ``{layer: entries × compress_ratio}``, the tokens a layer's written entries cover
            (fewer than ``num_tokens`` while a ratio-2 pair is open).
    """

    num_tokens: int
    global_bytes: int
    window_bytes: int
    tail_bytes: int
    per_layer: dict[int, tuple[int, int]]
    covered_tokens: dict[int, int]

    @property
    def global_bytes_per_token(self) -> float:
        """``global_bytes / num_tokens``: 890.0 for V4.1 at an even count, a little less while a pair is open."""
        return self.global_bytes / self.num_tokens if self.num_tokens else 0.0

    @property
    def global_bytes_per_covered_token(self) -> float:
        """Σ over KV-source layers of bytes written / tokens those entries cover (890.0 for V4.1 always)."""
        return sum(
            (m + i) / self.covered_tokens[layer]
            for layer, (m, i) in self.per_layer.items()
            if self.covered_tokens[layer]
        )

    @property
    def total_bytes(self) -> int:
        return self.global_bytes + self.window_bytes + self.tail_bytes


@dataclass(slots=True)
class RequestState:
    """All cache state of one request (see the module docstring).

    Attributes:
        num_tokens: positions processed so far (the next token's position).
        windows: one ring per layer (`WindowRings` for V4.1: the batched decode step needs them).
        main: main-KV entries per KV-source layer.
        index_keys: index keys per KV-source layer.
        tails: compressor tails per ratio>1 KV-source layer.
        table: the request's block table in the device pool (shared by ``main`` and ``index_keys``).
        engram_history: last compressed token ids (int64, ≤ engram_max_ngram_size − 1, oldest first); a batch's
            share one tensor (views), so it is replaced, never written in place.
    """

    windows: Sequence[WindowRing]
    main: dict[int, PagedEntries]
    index_keys: dict[int, PagedEntries]
    tails: dict[int, CompressorTail]
    table: BlockTable
    engram_history: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    num_tokens: int = 0

    def cache_bytes(self) -> CacheBytes:
        """Bytes measured from the allocated storage (rows written for global KV; rings and tails in full)."""
        per_layer = {
            layer: (self.main[layer].nbytes, self.index_keys[layer].nbytes if layer in self.index_keys else 0)
            for layer in self.main
        }
        # tokens covered by the rows written: entries × ratio
        ratios = self.table.pool.ratios
        covered = {layer: len(self.main[layer]) * ratios[layer] for layer in self.main}
        return CacheBytes(
            num_tokens=self.num_tokens,
            global_bytes=sum(m + i for m, i in per_layer.values()),
            window_bytes=sum(w.nbytes for w in self.windows),
            tail_bytes=sum(t.nbytes for t in self.tails.values()),
            per_layer=per_layer,
            covered_tokens=covered,
        )
