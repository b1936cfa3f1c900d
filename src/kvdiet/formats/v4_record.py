"""V4 baseline record ``v4_fp8_record``: E4M3 on the first ``dim − rope_dim`` values, RoPE values in bf16.

Recipe (v41-spec §5.1–5.2, V4REF, vLLM ``fp8_ds_mla``): the first ``dim − rope_dim`` values ("nope") take
the MXFP8 recipe of ``fp8`` with blocks of 64 (``amax ≥ 1e-4``, ``s = 2^ceil(log2(amax/448))``, ``q =
e4m3(clamp(x/s, ±448))``, one UE8M0 byte per block); the last ``rope_dim`` values are rounded to bf16
(round-to-nearest-even) and stored raw, little-endian.

Entry (``layout.v4_record_format``): ``nope E4M3 bytes | rope bf16 bytes | UE8M0 scales | zero pad to 8``;
448 + 128 + 7 + 1 = 584 B at dim 512, rope 64. Shapes: ``x`` float32/bfloat16/float16 ``[..., dim]`` with
``dim − rope_dim`` a positive multiple of 64 (any leading dims); codes **int16** ``[..., dim]``, one per
value: the E4M3 bit pattern (0..255) for the nope values, the raw bf16 bit pattern for the rope values;
scales uint8 ``[..., (dim − rope_dim)/64]``; packed uint8 ``[..., bytes_per_entry]``; values float32, or
bfloat16 with ``dtype=`` (exact either way). ``rope_dim`` is keyword-only, default 64 (V4CFG); 0 is allowed.

Edge cases, error bound and idempotence are those of ``fp8`` for the nope part. RoPE values: ±inf/NaN raise
``ValueError``; values beyond the bf16 range saturate to ±bf16 max (about 3.39e38) instead of becoming inf;
the error is at most half a bf16 ulp; bf16 values pass through requantisation unchanged.

Errors: ``ValueError`` for a dtype other than float32/bfloat16/float16, dims that do not fit the record,
non-finite input, codes/scales/packed of the wrong dtype or width, nope codes outside 0..255, or a scale
byte outside 105..246.
"""

from __future__ import annotations

import torch

from kvdiet.formats.fp8 import SCALE_BYTES, dequantize_e4m3_chunk_, quantize_e4m3_chunk_
from kvdiet.formats.layout import EntryFormat, v4_record_format
from kvdiet.formats.scales import (
    as_rows,
    block_amax,
    check_codes_and_scales,
    check_scale_bytes,
    chunk_rows,
    decode_rows,
    entry_of_packed,
    row_chunks,
)

__all__ = [
    "decode_v4_record",
    "dequantize_v4_record",
    "encode_v4_record",
    "fake_quant_v4_record",
    "pack_v4_record",
    "quantize_v4_record",
    "unpack_v4_record",
]

Tensor = torch.Tensor
_NAME = "v4_fp8_record"
_BLOCK = 64
_BF16_MAX = torch.finfo(torch.bfloat16).max


def _entry(dim: int, rope_dim: int) -> EntryFormat:
    if rope_dim < 0 or dim <= rope_dim or (dim - rope_dim) % _BLOCK:
        raise ValueError(
            f"{_NAME}: dim {dim} minus rope_dim {rope_dim} must be a positive multiple of {_BLOCK}"
        )
    return v4_record_format(dim, rope_dim)


def _rope_bits(xt: Tensor, work: Tensor, row: int) -> Tensor:
    # xt: [r, rope] float (strided) -> int16 bf16 bit patterns [r, rope]
    if xt.shape[1]:
        block_amax(xt.view(xt.shape[0], 1, -1), work, name=_NAME, first_row=row)  # non-finite check
    if xt.dtype != torch.bfloat16:
        xt = xt.float().clamp(-_BF16_MAX, _BF16_MAX).to(torch.bfloat16)
    return xt.contiguous().view(torch.int16)


def _setup(x: Tensor, rope_dim: int) -> tuple[Tensor, EntryFormat, Tensor, Tensor, Tensor]:
    rows = as_rows(x, block=1, name=_NAME)
    fmt = _entry(rows.shape[1], rope_dim)
    n = chunk_rows(*rows.shape) * fmt.dim
    dev = rows.device
    nope = torch.empty(chunk_rows(*rows.shape), fmt.quantised_dim, dtype=torch.uint8, device=dev)
    return (
        rows,
        fmt,
        torch.empty(n, dtype=torch.float32, device=dev),
        torch.empty(n, dtype=torch.int32, device=dev),
        nope,
    )


def quantize_v4_record(x: Tensor, *, rope_dim: int = 64) -> tuple[Tensor, Tensor]:
    """``x [..., dim]`` → (codes int16 ``[..., dim]``, UE8M0 scale bytes uint8 ``[..., (dim − rope)/64]``)."""
    rows, fmt, ybuf, work, nope = _setup(x, rope_dim)
    q = fmt.quantised_dim
    codes = torch.empty(rows.shape, dtype=torch.int16, device=rows.device)
    scales = torch.empty(rows.shape[0], fmt.num_scales, dtype=torch.uint8, device=rows.device)
    for sl in row_chunks(*rows.shape):
        u8 = nope[: sl.stop - sl.start]
        quantize_e4m3_chunk_(rows[sl, :q], u8, scales[sl], ybuf, work, block=_BLOCK, name=_NAME, row=sl.start)
        codes[sl, :q].copy_(u8)
        codes[sl, q:].copy_(_rope_bits(rows[sl, q:], work, sl.start))
    return codes.view(x.shape), scales.view(*x.shape[:-1], fmt.num_scales)


def encode_v4_record(x: Tensor, *, rope_dim: int = 64) -> Tensor:
    """Fused quantise + pack (the cache write): ``x [..., dim]`` → uint8 ``[..., bytes_per_entry]``."""
    rows, fmt, ybuf, work, _ = _setup(x, rope_dim)
    q, so = fmt.quantised_dim, fmt.scale_offset
    packed = torch.empty(rows.shape[0], fmt.bytes_per_entry, dtype=torch.uint8, device=rows.device)
    packed[:, so + fmt.num_scales :] = 0
    for sl in row_chunks(*rows.shape):
        codes, scales = packed[sl, :q], packed[sl, so : so + fmt.num_scales]
        quantize_e4m3_chunk_(rows[sl, :q], codes, scales, ybuf, work, block=_BLOCK, name=_NAME, row=sl.start)
        packed[sl, q:so].copy_(_rope_bits(rows[sl, q:], work, sl.start).view(torch.uint8))
    return packed.view(*x.shape[:-1], fmt.bytes_per_entry)


def pack_v4_record(codes: Tensor, scales: Tensor, *, rope_dim: int = 64) -> Tensor:
    """(codes int16, scale bytes) → records uint8 ``[..., bytes_per_entry]`` (584 B at dim 512, rope 64)."""
    fmt = _check_pair(codes, scales, rope_dim)
    q, so = fmt.quantised_dim, fmt.scale_offset
    packed = torch.zeros(*codes.shape[:-1], fmt.bytes_per_entry, dtype=torch.uint8, device=codes.device)
    packed[..., :q] = codes[..., :q]
    packed[..., q:so] = codes[..., q:].contiguous().view(torch.uint8)
    packed[..., so : so + fmt.num_scales] = scales
    assert packed.shape[-1] == fmt.bytes_per_entry
    return packed


def unpack_v4_record(packed: Tensor, *, rope_dim: int = 64) -> tuple[Tensor, Tensor]:
    """Records uint8 ``[..., bytes_per_entry]`` → (codes int16 ``[..., dim]``, scale bytes uint8)."""
    fmt = _entry_of(packed, rope_dim)
    q, so = fmt.quantised_dim, fmt.scale_offset
    codes = torch.empty(*packed.shape[:-1], fmt.dim, dtype=torch.int16, device=packed.device)
    codes[..., :q] = packed[..., :q]
    codes[..., q:] = packed[..., q:so].contiguous().view(torch.int16)
    return codes, packed[..., so : so + fmt.num_scales].contiguous()


def dequantize_v4_record(
    codes: Tensor, scales: Tensor, *, rope_dim: int = 64, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(codes int16, scale bytes) → ``[..., dim]`` in ``dtype``: ``e4m3(code) × s`` for nope, bf16 for rope.

    ``dtype`` is float32 or bfloat16; both are exact.
    """
    fmt = _check_pair(codes, scales, rope_dim)
    q, c2, s2 = fmt.quantised_dim, codes.reshape(-1, fmt.dim), scales.reshape(-1, fmt.num_scales)
    return _decode(c2[:, :q].to(torch.uint8), c2[:, q:], s2, dtype).view(codes.shape)


def decode_v4_record(packed: Tensor, *, rope_dim: int = 64, dtype: torch.dtype = torch.float32) -> Tensor:
    """Fused unpack + dequantise (the cache read): records → ``[..., dim]`` in ``dtype``."""
    fmt = _entry_of(packed, rope_dim)
    q, so = fmt.quantised_dim, fmt.scale_offset
    rows = packed.reshape(-1, fmt.bytes_per_entry)
    scales = rows[:, so : so + fmt.num_scales]
    check_scale_bytes(scales, SCALE_BYTES, name=_NAME)
    return _decode(rows[:, :q], rows[:, q:so], scales, dtype).view(*packed.shape[:-1], fmt.dim)


def fake_quant_v4_record(x: Tensor, *, rope_dim: int = 64, dtype: torch.dtype = torch.float32) -> Tensor:
    """``dequantize(quantize(x))`` in ``dtype``: what the quantised reference path sees."""
    return dequantize_v4_record(*quantize_v4_record(x, rope_dim=rope_dim), rope_dim=rope_dim, dtype=dtype)


def _decode(nope: Tensor, rope: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    # nope uint8 [N, q]; rope [N, rope_dim] int16 or [N, 2·rope_dim] uint8 (bf16 bits); scales uint8 [N, nb]
    n, q = nope.shape
    dim = q + rope.shape[1] * rope.element_size() // 2
    work = torch.empty(chunk_rows(n, dim) * q, dtype=torch.int16, device=nope.device)

    def fill(sl: slice, out: Tensor) -> None:
        dequantize_e4m3_chunk_(nope[sl], scales[sl], out[:, :q], work, block=_BLOCK)
        out[:, q:] = rope[sl].contiguous().view(torch.bfloat16)

    return decode_rows(n, dim, fill, dtype=dtype, name=_NAME, device=nope.device)


def _check_pair(codes: Tensor, scales: Tensor, rope_dim: int) -> EntryFormat:
    fmt = check_codes_and_scales(
        codes,
        scales,
        lambda dim: _entry(dim, rope_dim),
        codes_dtype=torch.int16,
        scale_bytes=SCALE_BYTES,
        name=_NAME,
    )
    nope = codes[..., : fmt.quantised_dim]
    if nope.numel() and (int(nope.min()) < 0 or int(nope.max()) > 255):
        lo, hi = int(nope.min()), int(nope.max())
        raise ValueError(f"{_NAME}: nope codes must be E4M3 bytes 0..255, got {lo}..{hi}")
    return fmt


def _entry_of(packed: Tensor, rope_dim: int) -> EntryFormat:
    # 64 value bytes + 1 scale byte per block after the 2·rope_dim tail bytes; the pad is under 8 bytes
    def dim_of_width(width: int) -> int:
        return (width - 2 * rope_dim) // (_BLOCK + 1) * _BLOCK + rope_dim

    return entry_of_packed(packed, dim_of_width, lambda dim: _entry(dim, rope_dim), name=_NAME)
