"""V4.1 main compressed KV entry ``fp4_e2m1_e4m3x16``: E2M1 values, one E4M3 scale per 16 (NVFP4-style).

Also home of the FP4 block codec (``Fp4Recipe`` and the ``*_fp4`` functions) that ``mxfp4`` reuses.

Recipe (v41-spec §5.1; DeepSeek reference kernel ``fp4_act_quant(x, 16, e4m3)``; vLLM ``nvfp4_ds_mla``), per
block of 16 values, in fp32, with a true division ``x / s``::

    amax = max(max|x|, 6·2^-9);  s = e4m3(min(amax / 6, 448));  q = RNE_e2m1(clamp(x / s, ±6))

There is **no global scale** (REF has none): each block carries its own E4M3 scale byte, so a caller
cannot pass a global scale of 0 or 1e-50 (case B15). Entry (v41-spec §5.2, ``layout.main_kv_format``):
dim/2 bytes of nibbles (low nibble = even element) + dim/16 E4M3 bytes; 512 values → 256 + 32 = 288 B.

Shapes and dtypes: ``x`` float32/bfloat16/float16 ``[..., dim]``, dim a multiple of 16, any leading dims
(none or zero-size too); codes uint8 ``[..., dim]`` (0..15, see ``e2m1``); scales uint8 ``[..., dim/16]``
(E4M3 bit patterns 0x01..0x7E: finite, positive); packed uint8 ``[..., 9·dim/16]``; dequantised values
float32 ``[..., dim]``, or bfloat16 with ``dtype=`` (exact either way).

Edge cases:
- all-zero block: sentinel scale 2^-9 (byte 0x01); dequantises to exactly 0.
- tiny values flush: ``|x| ≤ s/4`` becomes ±0, and ``s ≥ 2^-9``, so any ``|x| ≤ 2^-11`` (1e-30) is ±0.
- huge values saturate: ``s ≤ 448``, so ``|x| > 2688`` gives ±2688; every finite input (1e38) gives finite
  outputs. (REF casts without the clamp; torch 2.13's E4M3 cast saturates at 448 itself, +inf included, so
  REF agrees rather than giving the NaN scale v41-spec §5.1 guesses.) ±inf/NaN input raises ``ValueError``.
- error: ``|x − v| ≤ s·step/2`` (step 0.5, 1, 2 for ``|x|/s`` in [0,2], [2,4], [4,6]), else ``|x| − 6s``
  (saturation). Normal scales keep ``amax/s ≤ 6.375``, inside that bound; subnormal E4M3 scales
  (``s < 2^-6``, block amax < 45·2^-9 ≈ 0.088) can leave ``amax/s`` up to 9 (error up to 3s).
- idempotence: a block holding a ±6 code (magnitude index 7) requantises to the same scale (6s/6 = s) and
  codes, so ``dequantize(quantize(dequantize(q)))`` equals ``dequantize(q)`` bit for bit. ``quantize``
  yields such blocks whenever the scale is normal (amax ≥ 45·2^-9) or saturated. Other blocks may change:
  ``s = 2^-8`` with top value 2^-6 (code 6, value 4) requantises to ``s = 2^-9``, and 2^-6 → 6·2^-9.

Errors: ``ValueError`` for an input dtype other than float32/bfloat16/float16, a last dim not a multiple
of 16, non-finite input, codes/scales/packed of the wrong dtype or width, codes above 15, or a scale byte
outside 0x01..0x7E.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdiet.formats import e2m1, native
from kvdiet.formats.layout import EntryFormat, main_kv_format
from kvdiet.formats.scales import (
    E4M3_SCALE_BYTES,
    PendingCheck,
    as_rows,
    block_amax,
    check_codes_and_scales,
    check_scale_bytes,
    chunk_rows,
    decode_rows,
    e4m3_scale,
    e4m3_scale_to_float,
    entry_of_packed,
    non_finite_error,
    output_dtype,
    row_chunks,
)

__all__ = [
    "MAIN_KV",
    "Fp4Recipe",
    "decode_main_kv",
    "dequantize_main_kv",
    "encode_main_kv",
    "fake_quant_main_kv",
    "gather_main_kv",
    "pack_main_kv",
    "quantize_main_kv",
    "unpack_main_kv",
]

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Fp4Recipe:
    """How an FP4 format scales its blocks (all that differs between ``fp4`` and ``mxfp4``).

    Attributes:
        name: format name, for errors.
        block: values per scale.
        entry: ``dim -> EntryFormat`` from ``layout``.
        scale_bytes: stored scale bytes the recipe writes (inclusive range); others are rejected.
        scale: block amax float32 ``[r, nb]`` (may be modified in place) → ``(s float32, byte uint8)``.
        scale_to_float: stored scale bytes → float32 ``s``.
        kernel: recipe id of the compiled kernels (``native.RECIPE_*``).
    """

    name: str
    block: int
    entry: Callable[[int], EntryFormat]
    scale_bytes: tuple[int, int]
    scale: Callable[[Tensor], tuple[Tensor, Tensor]]
    scale_to_float: Callable[[Tensor], Tensor]
    kernel: int


def _main_kv_scale(amax: Tensor) -> tuple[Tensor, Tensor]:
    return e4m3_scale(amax.clamp_(min=6 * 2.0**-9) / 6)


MAIN_KV = Fp4Recipe(
    "fp4_e2m1_e4m3x16",
    16,
    main_kv_format,
    E4M3_SCALE_BYTES,
    _main_kv_scale,
    e4m3_scale_to_float,
    native.RECIPE_E4M3X16,
)


def _setup(x: Tensor, r: Fp4Recipe) -> tuple[Tensor, EntryFormat, Tensor, Tensor]:
    rows = as_rows(x, block=r.block, name=r.name)
    fmt = r.entry(rows.shape[1])
    n = chunk_rows(*rows.shape) * fmt.dim
    dev = rows.device
    return (
        rows,
        fmt,
        torch.empty(n, dtype=torch.float32, device=dev),
        torch.empty(2 * n, dtype=torch.int32, device=dev),
    )


def _quantize_chunk(
    xc: Tensor, r: Fp4Recipe, ybuf: Tensor, work: Tensor, row: int, pending: list[PendingCheck] | None = None
) -> tuple[Tensor, Tensor]:
    # xc: [rows, dim] -> (int32 codes [rows, dim] living in ybuf, scale bytes [rows, dim/block]); pending: as
    # `block_amax` (a non-finite value's block gets a finite scale; e2m1 clamps a non-finite value to ±6)
    xb = xc.view(xc.shape[0], -1, r.block)
    s, scale_bytes = r.scale(block_amax(xb, work, name=r.name, first_row=row, pending=pending))
    y = ybuf[: xc.numel()].view(xb.shape)
    if xc.dtype == torch.float32:
        torch.div(xb, s.unsqueeze(-1), out=y)
    else:
        y.copy_(xb).div_(s.unsqueeze(-1))
    return e2m1.encode_e2m1_(y, work).view(xc.shape), scale_bytes


def quantize_fp4(x: Tensor, *, recipe: Fp4Recipe) -> tuple[Tensor, Tensor]:
    """``x [..., dim]`` → (codes uint8 ``[..., dim]``, scale bytes uint8 ``[..., dim/block]``)."""
    rows, fmt, ybuf, work = _setup(x, recipe)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(rows.shape[0], fmt.num_scales, dtype=torch.uint8, device=rows.device)
    for sl in row_chunks(*rows.shape):
        c, s = _quantize_chunk(rows[sl], recipe, ybuf, work, sl.start)
        codes[sl].copy_(c)
        scales[sl].copy_(s)
    return codes.view(x.shape), scales.view(*x.shape[:-1], fmt.num_scales)


def encode_fp4(x: Tensor, *, recipe: Fp4Recipe, pending: list[PendingCheck] | None = None) -> Tensor:
    """Fused ``pack_fp4(*quantize_fp4(x))``: ``x [..., dim]`` → uint8 entries ``[..., bytes_per_entry]``.

    Runs the compiled kernels (``native``, CPU tensors only) when available, else the pure-torch chunks (on
    any device); the bytes are equal. ``pending``: None raises a non-finite row's error now (one host read per
    chunk of rows on the pure-torch path); a list gets that check appended instead (`scales.block_amax`, no
    host read; a compiled kernel that finds one hands the rows to the pure-torch chunks) and a non-finite row
    is encoded as bytes within the written ranges (finite when decoded); finite rows' bytes are the same.

    Raises:
        ValueError: ``x`` holds ±inf or NaN, naming the first such row (``pending`` None); as `as_rows`.
    """
    kernels = native.fp4_kernels() if x.device.type == "cpu" else None
    if kernels is not None:
        rows = as_rows(x, block=recipe.block, name=recipe.name)
        packed = torch.empty(rows.shape[0], recipe.entry(rows.shape[1]).bytes_per_entry, dtype=torch.uint8)
        bad = kernels.encode_fp4(rows, recipe.kernel, packed) if rows.shape[0] else -1
        if bad < 0:
            return packed.view(*x.shape[:-1], packed.shape[1])
        if pending is None:
            raise non_finite_error(recipe.name, bad)
    rows, fmt, ybuf, work = _setup(x, recipe)
    packed = torch.empty(rows.shape[0], fmt.bytes_per_entry, dtype=torch.uint8, device=rows.device)
    assert fmt.value_bytes + fmt.num_scales == fmt.bytes_per_entry  # no tail, no pad
    for sl in row_chunks(*rows.shape):
        c, s = _quantize_chunk(rows[sl], recipe, ybuf, work, sl.start, pending)
        e2m1.pack_codes_(c, packed[sl, : fmt.value_bytes], work)
        packed[sl, fmt.scale_offset :].copy_(s)
    return packed.view(*x.shape[:-1], fmt.bytes_per_entry)


def pack_fp4(codes: Tensor, scales: Tensor, *, recipe: Fp4Recipe) -> Tensor:
    """codes uint8 ``[..., dim]`` + scale bytes ``[..., dim/block]`` → uint8 ``[..., bytes_per_entry]``."""
    fmt = _check_pair(codes, scales, recipe)
    packed = torch.cat([e2m1.pack_nibbles(codes), scales], dim=-1)
    assert packed.shape[-1] == fmt.bytes_per_entry
    return packed


def unpack_fp4(packed: Tensor, *, recipe: Fp4Recipe) -> tuple[Tensor, Tensor]:
    """uint8 ``[..., bytes_per_entry]`` → (codes uint8 ``[..., dim]``, scale bytes ``[..., dim/block]``)."""
    fmt = _entry_of(packed, recipe)
    scales = packed[..., fmt.scale_offset :].contiguous()
    return e2m1.unpack_nibbles(packed[..., : fmt.value_bytes]), scales


def dequantize_fp4(codes: Tensor, scales: Tensor, *, recipe: Fp4Recipe, dtype: torch.dtype) -> Tensor:
    """codes + scale bytes → ``dtype`` (float32 or bfloat16, both exact) ``[..., dim]``: code value × s."""
    fmt = _check_pair(codes, scales, recipe)
    c2, s2 = codes.reshape(-1, fmt.dim), scales.reshape(-1, fmt.num_scales)

    def fill(sl: slice, out: Tensor) -> None:
        e2m1.decode_e2m1(c2[sl], out=out)
        s = recipe.scale_to_float(s2[sl])
        out.view(-1, fmt.num_scales, recipe.block).mul_(s.unsqueeze(-1))

    return decode_rows(*c2.shape, fill, dtype=dtype, name=recipe.name, device=codes.device).view(codes.shape)


def decode_fp4(
    packed: Tensor, *, recipe: Fp4Recipe, dtype: torch.dtype, pending: list[PendingCheck] | None = None
) -> Tensor:
    """Fused ``dequantize_fp4(*unpack_fp4(packed))``: entries → ``dtype`` ``[..., dim]``.

    Runs the compiled kernels (``native``, CPU tensors only) when available, else the pure-torch chunks (on
    any device); the values are equal. ``pending``: None raises on a scale byte outside ``recipe.scale_bytes``
    now (one host read on the pure-torch path); a list gets that check appended instead
    (`scales.check_scale_bytes`, no host read; a compiled kernel that finds one hands the rows to the
    pure-torch chunks) and each scale byte is read clamped into the range (finite values; the same values
    where every byte is in range).

    Raises:
        ValueError: a scale byte outside ``recipe.scale_bytes`` (``pending`` None); as `entry_of_packed` and
            `output_dtype`.
    """
    fmt = _entry_of(packed, recipe)
    rows = packed.reshape(-1, fmt.bytes_per_entry)
    kernels = native.fp4_kernels() if packed.device.type == "cpu" else None
    if kernels is not None:
        out = torch.empty(rows.shape[0], fmt.dim, dtype=output_dtype(dtype, name=recipe.name))
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            rows = rows.contiguous()
        lo, hi = recipe.scale_bytes
        if not rows.shape[0] or kernels.decode_fp4(rows, recipe.kernel, lo, hi, out) < 0:
            return out.view(*packed.shape[:-1], fmt.dim)
    scales = check_scale_bytes(
        rows[:, fmt.scale_offset :], recipe.scale_bytes, name=recipe.name, pending=pending
    )  # raises when pending None; clamped where deferred
    table = e2m1.pair_table(rows.device)

    def fill(sl: slice, out: Tensor) -> None:
        e2m1.decode_packed_(rows[sl, : fmt.value_bytes], out, table)
        s = recipe.scale_to_float(scales[sl])
        out.view(-1, fmt.num_scales, recipe.block).mul_(s.unsqueeze(-1))

    return decode_rows(rows.shape[0], fmt.dim, fill, dtype=dtype, name=recipe.name, device=rows.device).view(
        *packed.shape[:-1], fmt.dim
    )


def _check_pair(codes: Tensor, scales: Tensor, r: Fp4Recipe) -> EntryFormat:
    return check_codes_and_scales(
        codes, scales, r.entry, codes_dtype=torch.uint8, scale_bytes=r.scale_bytes, name=r.name
    )


def _entry_of(packed: Tensor, r: Fp4Recipe) -> EntryFormat:
    return entry_of_packed(
        packed,
        lambda width: width * 8 * r.block // (4 * r.block + 8),
        functools.partial(_entry, r),
        name=r.name,
    )


@functools.cache
def _entry(r: Fp4Recipe, dim: int) -> EntryFormat:
    """``r.entry(dim)``, built once per recipe and width: an `EntryFormat` checks itself when made, and a decode
    step decodes main-KV entries in every compressed layer (an error is raised on every call, not kept)."""
    return r.entry(dim)


def quantize_main_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., dim]`` → (codes uint8 ``[..., dim]``, E4M3 scale bytes uint8 ``[..., dim/16]``)."""
    return quantize_fp4(x, recipe=MAIN_KV)


def dequantize_main_kv(codes: Tensor, scales: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """(codes, E4M3 scale bytes) → ``[..., dim]`` in ``dtype`` (float32 or bfloat16; both exact)."""
    return dequantize_fp4(codes, scales, recipe=MAIN_KV, dtype=dtype)


def pack_main_kv(codes: Tensor, scales: Tensor) -> Tensor:
    """(codes, scale bytes) → 288-B entries (dim 512): uint8 ``[..., dim/2 + dim/16]``."""
    return pack_fp4(codes, scales, recipe=MAIN_KV)


def unpack_main_kv(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Entries uint8 ``[..., dim/2 + dim/16]`` → (codes, scale bytes)."""
    return unpack_fp4(packed, recipe=MAIN_KV)


def encode_main_kv(x: Tensor, *, pending: list[PendingCheck] | None = None) -> Tensor:
    """Fused quantise + pack (the cache write): ``x [..., dim]`` → entries uint8 ``[..., 9·dim/16]``
    (``pending``: `encode_fp4`)."""
    return encode_fp4(x, recipe=MAIN_KV, pending=pending)


def decode_main_kv(
    packed: Tensor, *, dtype: torch.dtype = torch.float32, pending: list[PendingCheck] | None = None
) -> Tensor:
    """Fused unpack + dequantise (the cache read): entries → ``[..., dim]`` in ``dtype`` (``pending``:
    `decode_fp4`)."""
    return decode_fp4(packed, recipe=MAIN_KV, dtype=dtype, pending=pending)


def gather_main_kv(
    rows: Tensor,
    table: Tensor,
    idx: Tensor,
    counts: list[int],
    per_block: int,
    out: Tensor | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor | None:
    """A decode step's read of its selected main-KV entries through the block tables, in one compiled call
    (``gather_kernels.cpp``), or None where the torch path runs (`BatchTables.gather`).

    Request b's entry ``idx[b, j]`` (j < ``counts[b]``; e = ``idx[b, j]``) is pool row ``table[b, e //
    per_block]·per_block + e % per_block`` of ``rows``; the result, ``[B, K, dim]`` in ``dtype``, holds
    ``decode_main_kv`` of that row, and +0 for j ≥ ``counts[b]``. In bf16 (the default) the values are the
    same, exactly: an FP4 value times its E4M3 scale has at most six significant bits, so bf16 holds it, and the
    layers that attend the entries re-read half the bytes (`kvdiet.model.decode_attend` reads them as fp32).

    Args:
        rows: uint8 [N, 9·dim/16], a layer's pool rows (row stride free, unit element stride).
        table: int64 [B, T] contiguous, each request's block ids (`BatchTables.table`).
        idx: int64 [B, K] contiguous, each request's entries; only the first ``counts[b]`` are read.
        counts: B ints, how many of ``idx[b]`` request b reads (at most K are).
        per_block: entries per block of the layer (`DevicePool.entries_per_block`).
        out: None, or a ``dtype`` [B, K, dim] contiguous CPU tensor to write the result into (and return; every
            element is written). Another shape, dtype or layout is not used.
        dtype: torch.bfloat16 or torch.float32.

    None (nothing raised) when the kernels are not built (``native``) or the input is not what the kernel takes:
    another dtype, device or layout, an entry whose block lies outside its table or whose row lies outside
    ``rows``, a read entry with a scale byte outside ``MAIN_KV.scale_bytes``; the torch path then gives the same
    result or raises (or defers) the error.

    Raises:
        ValueError: ``dtype`` is neither bf16 nor fp32.
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gather_main_kv writes bfloat16 or float32, not {dtype}")
    kernels = native.fp4_kernels()
    if kernels is None or rows.dim() != 2 or idx.dim() != 2 or not (rows.is_cpu and idx.is_cpu):
        return None
    dim = rows.shape[1] * 16 // 9
    out = native.kernel_output(out, (*idx.shape, dim), dtype)
    lo, hi = MAIN_KV.scale_bytes
    if kernels.gather_fp4(rows, table, idx, counts, per_block, MAIN_KV.kernel, lo, hi, out):
        return out
    return None


def fake_quant_main_kv(x: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``dequantize(quantize(x))`` in ``dtype``: what the quantised reference path sees."""
    return dequantize_main_kv(*quantize_main_kv(x), dtype=dtype)
