"""E2M1 (FP4): the one encoder, decoder and nibble packer shared by both FP4 formats.

Grid (v41-spec §5.1): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; a code is ``sign << 3 | index`` (index 0..7
into that grid), so codes 8..15 are the negatives and code 8 is −0.0.

- **Rounding**: values are clamped to ±6 (beyond saturates to ±6, never NaN), then rounded to nearest with
  ties to even (the grid point whose index is even): 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4,
  negatives mirror (case B12).
- **Sign of zero**: kept, as in any sign-magnitude float conversion: −0.0 and negatives that round to 0
  get code 8, which decodes to −0.0 (== 0); requantising −0.0 gives code 8 again. Positive zero is code 0.
- **Packing**: two codes per byte, low nibble = even element (case B17; vLLM ``nvfp4_ds_mla``).

The fast encoder rounds with one fp32 add: ``|y| + 2^22·step`` has an ulp of exactly the grid step of
``|y|``'s binade (0.5 below 2, 1 up to 4, 2 up to 6), so the FPU's round-to-nearest-even picks the grid
point and the code falls out of the sum's bits. Scales and blocks are not known here: ``fp4`` (E4M3
scales, block 16) and ``mxfp4`` (UE8M0 scales, block 32) divide by their scale first.
"""

from __future__ import annotations

import functools
import struct
import sys

import torch

from kvdiet.formats.scales import as_rows, block_amax

__all__ = [
    "DECODE_TABLE",
    "E2M1_GRID",
    "E2M1_MAX",
    "decode_e2m1",
    "decode_packed_",
    "encode_e2m1",
    "encode_e2m1_",
    "pack_codes_",
    "pack_nibbles",
    "pair_table",
    "unpack_nibbles",
]

if sys.byteorder != "little":  # the int16/int32/int64 views below assume it
    raise ImportError("kvdiet.formats needs a little-endian host")

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
DECODE_TABLE = E2M1_GRID + tuple(-v for v in E2M1_GRID)
"""Value of each code 0..15 (code 8 is −0.0)."""

# fp16 bit pattern of each code's value (fp16 holds every E2M1 value exactly)
_FP16_BITS = tuple(struct.unpack("<H", struct.pack("<e", v))[0] for v in DECODE_TABLE)


def encode_e2m1_(y: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Encode in place: ``y`` float32 (finite, already divided by its scale) becomes int32 codes 0..15.

    Args:
        y: contiguous float32, overwritten.
        work: int32 scratch of at least ``2 * y.numel()`` elements.

    Returns:
        ``y`` viewed as int32, holding the codes.
    """
    n = y.numel()
    yi = y.view(torch.int32)
    sign = torch.bitwise_right_shift(yi, 28, out=work[:n].view(y.shape)).bitwise_and_(8)
    yi.bitwise_and_(0x7FFFFFFF).clamp_(max=0x40C00000)  # |y| clamped to 6.0 (floats >= 0 sort as ints)
    magic = torch.clamp(yi, min=0x3F800000, out=work[n : 2 * n].view(y.shape))  # max(|y|, 1)
    magic.bitwise_and_(0x7F800000).add_(22 << 23)  # 2^22 · step of |y|'s binade, step ∈ {0.5, 1, 2}
    y.add_(magic.view(torch.float32))  # the one rounding: RNE to a multiple of step
    yi.sub_(magic)  # round(|y| / step)
    return yi.add_(magic.bitwise_right_shift_(22).sub_(298)).bitwise_or_(sign)  # + 2·log2(step/0.5)


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``y`` (float32/bfloat16/float16, any shape): clamp to ±6, round ties to even.

    Returns:
        uint8 codes 0..15, shaped like ``y``.

    Raises:
        ValueError: ``y`` is not float32/bfloat16/float16 or holds ±inf/NaN.
    """
    rows = as_rows(y.reshape(-1, 1), block=1, name="e2m1")
    work = torch.empty(2 * rows.numel(), dtype=torch.int32, device=rows.device)
    block_amax(rows.view(-1, 1, 1), work, name="e2m1")  # non-finite check
    return encode_e2m1_(rows.float().reshape(-1).clone(), work).to(torch.uint8).view(y.shape)


def decode_e2m1(codes: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Value of each uint8 code 0..15 (``DECODE_TABLE``), shaped like ``codes``; float32 unless ``out`` given.

    Args:
        codes: uint8, any shape.
        out: optional contiguous float tensor with ``codes.numel()`` elements to write into (any float dtype;
            every E2M1 value is exact in each).

    Raises:
        ValueError: ``codes`` is not uint8 or holds a value above 15.
    """
    _check_codes(codes)
    table = torch.tensor(DECODE_TABLE, dtype=torch.float32 if out is None else out.dtype, device=codes.device)
    index = codes.reshape(-1).to(torch.int32)
    if out is None:
        return torch.index_select(table, 0, index).view(codes.shape)
    torch.index_select(table, 0, index, out=out.view(-1))
    return out


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., n]`` (n even, values 0..15) two per byte, low nibble = even element.

    Returns:
        uint8 ``[..., n/2]``.

    Raises:
        ValueError: not uint8, odd or missing last dim, or a code above 15.
    """
    _check_codes(codes)
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(codes.shape)}")
    pairs = codes.contiguous().view(torch.int16)  # low byte = even element (little-endian)
    return torch.bitwise_or(pairs, pairs >> 4).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 ``[..., m]`` → uint8 codes ``[..., 2m]``.

    Raises:
        ValueError: ``packed`` is not uint8 or has no dims.
    """
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(f"unpack_nibbles: need uint8 [..., m], got {packed.dtype} {tuple(packed.shape)}")
    wide = packed.to(torch.int16, memory_format=torch.contiguous_format)
    wide = torch.bitwise_or(wide & 0x0F, (wide & 0xF0) << 4)
    return wide.view(torch.uint8)


def _check_codes(codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"e2m1 codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"e2m1 codes must be 0..15, got {int(codes.max())}")


def pack_codes_(codes: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> None:
    """Fast ``pack_nibbles`` for int32 codes from ``encode_e2m1_``, written into ``out``.

    Args:
        codes: int32 ``[r, n]``, contiguous, values 0..15 (not checked).
        out: uint8 ``[r, n/2]``, any row stride (e.g. the value bytes of packed entries).
        work: int32 scratch of at least ``codes.numel()`` elements.
    """
    n = codes.numel()
    narrow = work.view(torch.uint8)[:n].view(codes.shape).copy_(codes)
    pairs = narrow.view(torch.int16)  # low byte = even element, high byte = odd element
    packed = torch.bitwise_right_shift(pairs, 4, out=work.view(torch.int16)[n : 3 * n // 2].view(pairs.shape))
    out.copy_(packed.bitwise_or_(pairs))  # low byte: even | odd << 4; the copy keeps the low byte


@functools.cache
def pair_table(device: torch.device | None = None) -> torch.Tensor:
    """int32 ``[256]`` on ``device`` (None: the CPU): each byte's two nibble values as fp16 halves, the low
    nibble's first in memory. Built once per device; do not mutate."""
    bits = _FP16_BITS
    pairs = [((bits[b >> 4] << 16 | bits[b & 15]) ^ 2**31) - 2**31 for b in range(256)]  # as signed int32
    return torch.tensor(pairs, dtype=torch.int32, device=device)


def decode_packed_(packed: torch.Tensor, out: torch.Tensor, table: torch.Tensor) -> None:
    """Unscaled values of packed E2M1 bytes: uint8 ``[r, m]`` (any row stride) → float32 ``out [r, 2m]``.

    One gather per byte through ``table = pair_table()`` (fp16 pairs in element order), then a widening
    copy into the contiguous ``out``: about half the cost of gathering each nibble's float32 value.
    """
    index = packed.to(torch.int32, memory_format=torch.contiguous_format).view(-1)
    out.view(-1).copy_(torch.index_select(table, 0, index).view(torch.float16))
