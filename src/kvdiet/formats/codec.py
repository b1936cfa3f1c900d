"""One interface over the entry formats, so caches and the reference path never branch on a format.

A `Codec` turns fp32 vectors ``[..., dim]`` into stored rows ``[..., width]`` and back. A packed codec
stores a format's bytes (uint8, ``width = bytes_per_entry``); the exact codec stores fp32 rows unchanged
(the unquantised mode of the exactness tests). `Codec.roundtrip` is what a stored value reads back as;
the no-cache reference applies it at the same points where the cached path stores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvdiet.formats import fp4, fp8, mxfp4, v4_record
from kvdiet.formats.layout import (
    EntryFormat,
    index_key_format,
    main_kv_format,
    v4_record_format,
    window_format,
)
from kvdiet.formats.scales import PendingCheck
from kvdiet.setting_error import SettingError

__all__ = ["CacheCodecs", "Codec", "FusedGather", "WindowRead", "exact_codec", "packed_codec"]

WindowRead = Callable[
    [torch.Tensor, Sequence[torch.Tensor], torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor] | None,
]
"""A fused `Codec.read_window`: ``(kv, rings, slots, held, out)`` → its result, or None to run the torch path."""
FusedGather = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, list[int], int, torch.Tensor | None], torch.Tensor | None
]
"""A decode step's read of selected entries through block tables in one call, ``(rows, table, idx, counts,
per_block, out)`` → the decoded entries (in ``out`` where it fits), or None to run the torch path
(``fp4.gather_main_kv``)."""


@dataclass(frozen=True, slots=True)
class Codec:
    """Stores vectors of ``dim`` values as rows of ``width`` elements of ``dtype``.

    Attributes:
        name: format name (``fp32`` for the exact codec); part of a cache's identity.
        dim: values per vector.
        width: elements per stored row.
        dtype: element type of stored rows (uint8 for packed formats).
        encode: fp32 ``[..., dim]`` → rows ``[..., width]``.
        decode: rows ``[..., width]`` → fp32 ``[..., dim]``.
        fused_read: `read_window` in one call (``fp8.read_window``), or None where it returns None (then, and
            for codecs without one, `read_window` runs ``encode`` / ``decode`` and torch ops).
        fused_gather: a decode step's gather and ``decode`` of selected rows in one call (`FusedGather`,
            ``fp4.gather_main_kv``), or None (then, and where it returns None, `BatchTables.gather` runs torch ops).
        defers: ``encode`` and ``decode`` take ``pending=``, a list to append their value checks to as
            `PendingCheck` instead of reading them (the packed codecs of `CacheCodecs.for_dims`:
            ``fp8.encode_window``, ``fp4.encode_main_kv``, ``mxfp4.encode_index_key`` and their decodes);
            `encode_deferred` / `decode_deferred` pass it where it is taken.
    """

    name: str
    dim: int
    width: int
    dtype: torch.dtype
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    fused_read: WindowRead | None = None
    fused_gather: FusedGather | None = None
    defers: bool = False

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` in fp32: what a stored value reads back as."""
        return self.decode(self.encode(x))

    def read_window(
        self,
        kv: torch.Tensor,
        rings: Sequence[torch.Tensor],
        slots: torch.Tensor,
        held: torch.Tensor | None,
        *,
        pending: list[PendingCheck] | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's window read: each request's stored rows picked by slot, then its new key as stored.

        Args:
            kv: fp32 [B, dim], each request's new key (`Attention.project_window_kv`).
            rings: B stored rows [W_b, width] of this codec's dtype, one ring per request.
            slots: int64 [B, n], the rows of ``rings[b]`` to read, in order.
            held: bool [B, n], or None for all held: a row not held is read as the new key instead (a slot never
                written may hold bytes that do not decode).
            pending: None (the default) checks everything now. A list: the caller vouches that every slot lies
                in its ring (not checked), and the value checks of a codec that ``defers`` (a non-finite ``kv``,
                a held row's scale bytes) are appended to it in that order (`PendingCheck`, no host read) for
                the caller to run (`run_checks`) before it stores ``entries``; until then a failing value reads
                as finite bytes (see ``fp8.encode_window`` / ``fp8.decode_window``). A codec that does not
                defer checks its values now.
            out: None, or fp32 [B, n+1, dim] (contiguous, CPU) the fused read may write the keys into and return
                (a buffer its caller reuses: a decode step's layers one after another, so the keys stay in cache).

        Returns:
            ``(keys fp32 [B, n+1, dim], entries [B, width])``: ``keys[b, j] = decode(rings[b][slots[b, j]])``
            where held, else ``keys[b, n]``; ``keys[b, n] = roundtrip(kv[b])``; ``entries = encode(keys[:, n])``,
            what the ring stores (`Attention.forward` stores ``encode(roundtrip(kv))``). The decodes of the rows
            and of ``encode(kv)`` are one ``decode`` call; ``fused_read`` gives the same bits in one call.
            ``keys[:, n]`` is decoded from bytes ``encode`` wrote, so it is finite and its re-encode is not
            checked (a codec that ``defers``).

        Raises:
            ValueError: a slot outside its ring (before anything is read; ``pending`` None), or as ``encode`` /
                ``decode`` (a non-finite ``kv``, a held row that does not decode; ``pending`` None or a codec
                that does not defer).
        """
        # a lazily negated key is read as its value on both paths (no dispatch when it is not)
        if kv.is_neg():
            kv = kv.resolve_neg()
        if (
            self.fused_read is not None
            and (fused := self.fused_read(kv, rings, slots, held, out)) is not None
        ):
            return fused
        if slots.dim() != 2 or len(rings) != slots.shape[0]:
            raise ValueError(
                f"{self.name}: one ring per row of slots [B, n], got {len(rings)} and {tuple(slots.shape)}"
            )
        if pending is None and slots.numel():
            sizes = torch.tensor([ring.shape[0] for ring in rings], device=slots.device)
            bad = ((slots < 0) | (slots >= sizes[:, None])).any(1)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                lo, hi = int(slots[i].min()), int(slots[i].max())
                raise ValueError(
                    f"{self.name}: window slots must lie in [0, {int(sizes[i])}), got {lo}..{hi} (request {i})"
                )
        encoded = self.encode_deferred(kv, pending)  # [B, width]
        b, n = slots.shape
        rows = torch.empty(b, n + 1, self.width, dtype=encoded.dtype, device=kv.device)
        # rows picked by index_select (uint8 gather and where are ~15x slower on the CPU)
        for i, ring in enumerate(rings):
            torch.index_select(ring, 0, slots[i], out=rows[i, :-1])
        rows[:, -1] = encoded
        if held is not None:  # a slot not held reads the new entry
            older = rows[:, :-1]
            older.copy_(torch.where(held[..., None], older, encoded[:, None]))
        keys = self.decode_deferred(rows, pending)
        # keys[:, -1] decodes bytes encode wrote: finite, its check would never fail (a throwaway list)
        return keys, self.encode_deferred(keys[:, -1], [])

    def encode_deferred(self, x: torch.Tensor, pending: list[PendingCheck] | None) -> torch.Tensor:
        """``encode(x)`` with its value check (a non-finite row) appended to ``pending`` (no host read; the row
        is encoded as finite bytes until the caller runs it, `run_checks`) where that is a list and the codec
        ``defers``; else checked now.

        Raises:
            ValueError: as ``encode`` (``pending`` None, or a codec that does not defer).
        """
        return self.encode(x, pending=pending) if self.defers and pending is not None else self.encode(x)

    def decode_deferred(self, rows: torch.Tensor, pending: list[PendingCheck] | None) -> torch.Tensor:
        """``decode(rows)`` with its value check (a stored scale byte outside the written range) appended to
        ``pending`` (no host read; the byte reads clamped into the range until the caller runs it, `run_checks`)
        where that is a list and the codec ``defers``; else checked now.

        Raises:
            ValueError: as ``decode`` (``pending`` None, or a codec that does not defer).
        """
        return (
            self.decode(rows, pending=pending) if self.defers and pending is not None else self.decode(rows)
        )

    @property
    def bytes_per_entry(self) -> int:
        """Bytes one stored row occupies."""
        return self.width * torch.empty((), dtype=self.dtype).element_size()


def exact_codec(dim: int, dtype: torch.dtype = torch.float32) -> Codec:
    """Rows of ``dtype`` (fp32, or fp64 for a model run in fp64), unchanged (``roundtrip`` is the identity on
    input of that dtype)."""
    name = "fp32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
    return Codec(name, dim, dim, dtype, lambda x: x.to(dtype).clone(), lambda r: r.to(dtype).clone())


def packed_codec(
    fmt: EntryFormat,
    module: ModuleType,
    suffix: str,
    *,
    fused_read: WindowRead | None = None,
    fused_gather: FusedGather | None = None,
    defers: bool = False,
) -> Codec:
    """The packed codec of ``fmt``, from ``module``'s fused ``encode_{suffix}`` / ``decode_{suffix}`` (and
    ``fused_read``, `Codec.read_window` in one call; ``fused_gather``, `Codec.fused_gather`; ``defers``: they take
    ``pending=``, `Codec.defers`)."""
    return Codec(
        fmt.name,
        fmt.dim,
        fmt.bytes_per_entry,
        torch.uint8,
        getattr(module, f"encode_{suffix}"),
        getattr(module, f"decode_{suffix}"),
        fused_read=fused_read,
        fused_gather=fused_gather,
        defers=defers,
    )


@dataclass(frozen=True, slots=True)
class CacheCodecs:
    """The three cache codecs of a model: main KV, index keys, window entries (v41-spec §5.2; V4-Flash:
    `for_v4`)."""

    main: Codec
    index_key: Codec
    window: Codec

    @classmethod
    def for_dims(cls, head_dim: int, index_head_dim: int, *, exact: bool = False) -> CacheCodecs:
        """Codecs for KV vectors of ``head_dim`` and index keys of ``index_head_dim``; ``exact`` → fp32.

        Raises:
            SettingError (a ValueError): packed codecs for a ``head_dim`` that is not a multiple of 32 (the
                window's MXFP8 scale block; the main KV's FP4 block is 16), naming it and the way out
                (``kv_cache_dtype='fp32'``, or ``--kv-cache-dtype fp32`` on the command line).
        """
        if not exact and head_dim % 32:
            raise SettingError(
                f"head_dim {head_dim} is not a multiple of 32: the packed window entries (MXFP8) and main KV (FP4) "
                f"take whole scale blocks (v41-spec §5); use exact caches, {{kv_cache_dtype=fp32}}"
            )
        if exact:
            return cls(exact_codec(head_dim), exact_codec(index_head_dim), exact_codec(head_dim))
        return cls(
            packed_codec(
                main_kv_format(head_dim), fp4, "main_kv", fused_gather=fp4.gather_main_kv, defers=True
            ),
            packed_codec(index_key_format(index_head_dim), mxfp4, "index_key", defers=True),
            packed_codec(window_format(head_dim), fp8, "window", fused_read=fp8.read_window, defers=True),
        )

    @classmethod
    def for_v4(
        cls,
        head_dim: int,
        index_head_dim: int,
        rope_dim: int,
        *,
        exact: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> CacheCodecs:
        """V4-Flash's packed codecs: the FP8 record (E4M3 nope dims + bf16 RoPE dims, 584 B at 512/64) for main
        KV and window entries, MXFP4 index keys (68 B at 128) (v41-spec §5.2, §9); ``exact`` → unquantised
        rows of ``dtype``.

        Raises:
            ValueError: ``head_dim − rope_dim`` not a positive multiple of 64, or ``index_head_dim`` not a
                multiple of 32.
        """
        if exact:
            return cls(
                exact_codec(head_dim, dtype), exact_codec(index_head_dim, dtype), exact_codec(head_dim, dtype)
            )
        record = v4_record_format(head_dim, rope_dim)
        v4 = Codec(
            record.name,
            head_dim,
            record.bytes_per_entry,
            torch.uint8,
            functools.partial(v4_record.encode_v4_record, rope_dim=rope_dim),
            functools.partial(v4_record.decode_v4_record, rope_dim=rope_dim),
        )
        return cls(v4, packed_codec(index_key_format(index_head_dim), mxfp4, "index_key", defers=True), v4)
