"""V4.1 window (SWA) entry ``mxfp8``: E4M3 values, one UE8M0 (power-of-two) scale per 32 values.

Recipe (v41-spec §5.1, DeepSeek reference kernel ``act_quant(x, 32, ue8m0)``), per block, in fp32::

    amax = max(max|x|, 1e-4);  s = 2^ceil(log2(amax / 448));  q = e4m3(clamp(x / s, ±448))

``e4m3`` is ``torch.float8_e4m3fn`` round-to-nearest-even (it also saturates at ±448 in torch 2.13; the
explicit clamp keeps the recipe independent of that); the ceil is taken on the exact fp32 bits. The V4
record (``v4_record``) uses the same recipe with blocks of 64 through ``quantize_e4m3_chunk_`` and
``dequantize_e4m3_chunk_``.

Entry (v41-spec §5.2, vLLM "V4.1 MXFP8 record"): 512 values → 512 E4M3 bytes + 16 UE8M0 bytes = 528 B
(``layout.window_format``). Shapes: ``x`` float32/bfloat16/float16 ``[..., dim]`` (dim a multiple of 32, any
leading dims); codes uint8 ``[..., dim]`` (E4M3 bit patterns); scales uint8 ``[..., dim/32]`` (byte =
exponent + 127, written range 105..246); packed uint8 ``[..., 33·dim/32]``; values float32 ``[..., dim]``,
or bfloat16 with ``dtype=`` (exact either way). ``read_window``: a decode step's window read (ring rows picked
by slot, the new entry encoded, decoded and re-encoded) in one compiled call, for `Codec.read_window`.

Edge cases:
- all-zero block: sentinel scale ``2^ceil(log2(1e-4/448)) = 2^-22``, dequantises to exactly 0.
- tiny values: ``|x| ≤ 2^-10·s`` flushes to ±0 (half the smallest E4M3 subnormal); with ``s ≥ 2^-22``,
  every ``|x| ≤ 2^-32`` (e.g. 1e-30) becomes ±0.
- huge values: the scale exponent is capped at 119 so ``448·s`` stays finite; blocks with amax above
  ``448·2^118 ≈ 1.5e38`` use ``s = 2^119`` instead of REF's ``2^120`` and saturate at ``±448·2^119`` (REF
  would dequantise values ``≥ 248·2^120`` to inf). 1e38 is unaffected and finite.
- ±inf / NaN input: ``ValueError``. Codes 0x7F/0xFF (E4M3 NaN) are never written; decoding them yields
  ``±480·s``, not NaN.
- error: ``|x − v| ≤ max(2^-4·|x|, 2^-10·s)`` (half an E4M3 step); ``amax/s`` lies in (224, 448], so
  nothing saturates below the cap.
- idempotence: ``dequantize(quantize(dequantize(q)))`` equals ``dequantize(q)`` bit for bit for every
  valid ``(codes, scales)`` without NaN codes (the new scale is ``s·2^-j``; E4M3 values times ``2^j`` up to
  448 are E4M3 values). Codes stay the same iff the block's top magnitude exceeds 224 (code 0x76) or ``s``
  is the 2^-22 floor; from ``quantize`` only a top of exactly 224 rescales (``s/2``, doubled values).

Errors: ``ValueError`` for a dtype other than float32/bfloat16/float16, a last dim not a multiple of 32,
non-finite input, codes/scales/packed of the wrong dtype or width, or a scale byte outside 105..246.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvdiet.formats import native
from kvdiet.formats.layout import EntryFormat, window_format
from kvdiet.formats.scales import (
    E4M3_MAX,
    PendingCheck,
    as_rows,
    block_amax,
    check_codes_and_scales,
    check_scale_bytes,
    chunk_rows,
    decode_rows,
    entry_of_packed,
    row_chunks,
    ue8m0_scale,
    ue8m0_to_float,
)

__all__ = [
    "SCALE_BYTES",
    "decode_window",
    "dequantize_e4m3_chunk_",
    "dequantize_window",
    "encode_window",
    "fake_quant_window",
    "pack_window",
    "quantize_e4m3_chunk_",
    "quantize_window",
    "read_window",
    "unpack_window",
]

Tensor = torch.Tensor
_NAME = "mxfp8"
_BLOCK = 32
_MAX_EXPONENT = 119  # 448 · 2^119 ≈ 3.0e38 is the largest finite dequantised value
SCALE_BYTES = (127 - 22, 127 + _MAX_EXPONENT)
"""UE8M0 bytes the recipe writes: 2^-22 (the 1e-4 amax floor: ceil(log2(1e-4/448)) = -22) .. 2^119."""


def quantize_e4m3_chunk_(
    xc: Tensor,
    codes: Tensor,
    scales: Tensor,
    ybuf: Tensor,
    work: Tensor,
    *,
    block: int,
    name: str,
    row: int,
    pending: list[PendingCheck] | None = None,
) -> None:
    """Quantise rows ``xc [r, n]`` into ``codes`` uint8 ``[r, n]`` and ``scales`` uint8 ``[r, n/block]``.

    ``codes``/``scales`` may be strided views (the parts of packed entries). ``ybuf``: float32 scratch, and
    ``work``: int32 scratch, each of at least ``xc.numel()`` elements. ``row``: index of ``xc``'s first row,
    for errors. Raises ``ValueError`` on non-finite input, or appends that check to ``pending`` (`block_amax`).
    """
    xb = xc.view(xc.shape[0], -1, block)
    amax = block_amax(xb, work, name=name, first_row=row, pending=pending).clamp_(min=1e-4)
    s, scale_bytes = ue8m0_scale(amax / E4M3_MAX, max_exponent=_MAX_EXPONENT)
    y = ybuf[: xc.numel()].view(xb.shape)
    if xc.dtype == torch.float32:
        torch.div(xb, s.unsqueeze(-1), out=y)
    else:
        y.copy_(xb).div_(s.unsqueeze(-1))
    codes.view(torch.float8_e4m3fn).copy_(y.clamp_(-E4M3_MAX, E4M3_MAX).view(xc.shape))
    scales.copy_(scale_bytes)


def dequantize_e4m3_chunk_(codes: Tensor, scales: Tensor, out: Tensor, work: Tensor, *, block: int) -> None:
    """``codes`` uint8 ``[r, n]`` + UE8M0 ``scales`` ``[r, n/block]`` → ``out`` float32 ``[r, n]``.

    ``out``'s last dim must be contiguous (rows may be strided). E4M3 → fp16 by bits: sign-extend to int16,
    shift left 7 and clear bit 14; that fp16 equals the E4M3 value × 2^-8 exactly (subnormals included), so
    the 2^8 goes into the scale. ``work``: int16 scratch of at least ``codes.numel()`` elements.
    """
    half = work[: codes.numel()].view(codes.shape)
    half.copy_(codes.view(torch.int8)).bitwise_left_shift_(7).bitwise_and_(-0x4001)  # & 0xBFFF
    out.copy_(half.view(torch.float16))
    out.view(out.shape[0], -1, block).mul_(ue8m0_to_float(scales).mul_(256.0).unsqueeze(-1))


def _setup(rows: Tensor) -> tuple[EntryFormat, Tensor, Tensor]:
    n = chunk_rows(*rows.shape) * rows.shape[1]
    return (
        window_format(rows.shape[1]),
        torch.empty(n, dtype=torch.float32, device=rows.device),
        torch.empty(n, dtype=torch.int32, device=rows.device),
    )


def quantize_window(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., dim]`` → (E4M3 codes uint8 ``[..., dim]``, UE8M0 scale bytes uint8 ``[..., dim/32]``)."""
    rows = as_rows(x, block=_BLOCK, name=_NAME)
    fmt, ybuf, work = _setup(rows)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(rows.shape[0], fmt.num_scales, dtype=torch.uint8, device=rows.device)
    for sl in row_chunks(*rows.shape):
        quantize_e4m3_chunk_(
            rows[sl], codes[sl], scales[sl], ybuf, work, block=_BLOCK, name=_NAME, row=sl.start
        )
    return codes.view(x.shape), scales.view(*x.shape[:-1], fmt.num_scales)


def encode_window(x: Tensor, *, pending: list[PendingCheck] | None = None) -> Tensor:
    """Fused quantise + pack (the cache write): ``x [..., dim]`` → entries uint8 ``[..., 33·dim/32]``.

    float32 CPU input runs the compiled kernel (``native``) when available, else the pure-torch chunks (same
    bytes, same errors). ``pending``: None raises a non-finite row's error now (one host read on the pure-torch
    path); a list gets that check appended instead (`scales.block_amax`: no host read) and a non-finite row's
    bytes are written with its block scale capped (a NaN still encodes as E4M3's NaN code, which decodes to a
    large finite value: they stand in only until the check is read); finite rows' bytes are the same.
    """
    rows = as_rows(x, block=_BLOCK, name=_NAME)
    fmt, width = _format(rows.shape[1])
    packed = torch.empty(rows.shape[0], width, dtype=torch.uint8, device=rows.device)
    kernels = native.fp4_kernels() if rows.device.type == "cpu" and rows.dtype == torch.float32 else None
    if kernels is not None and (not rows.shape[0] or kernels.encode_fp8(rows, packed) < 0):
        return packed.view(*x.shape[:-1], width)
    _, ybuf, work = _setup(rows)  # the pure-torch path (and the error for a non-finite row)
    for sl in row_chunks(*rows.shape):
        codes, scales = packed[sl, : fmt.dim], packed[sl, fmt.dim :]
        quantize_e4m3_chunk_(
            rows[sl], codes, scales, ybuf, work, block=_BLOCK, name=_NAME, row=sl.start, pending=pending
        )
    return packed.view(*x.shape[:-1], width)


def pack_window(codes: Tensor, scales: Tensor) -> Tensor:
    """(codes, scale bytes) → 528-B entries (dim 512): uint8 ``[..., dim + dim/32]``."""
    fmt = _check_pair(codes, scales)
    packed = torch.cat([codes, scales], dim=-1)
    assert packed.shape[-1] == fmt.bytes_per_entry
    return packed


def unpack_window(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Entries uint8 ``[..., dim + dim/32]`` → (codes uint8 ``[..., dim]``, scale bytes ``[..., dim/32]``)."""
    fmt = _entry_of(packed)
    return packed[..., : fmt.dim].contiguous(), packed[..., fmt.scale_offset :].contiguous()


def dequantize_window(codes: Tensor, scales: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """(codes, UE8M0 scale bytes) → ``[..., dim]`` in ``dtype`` (float32 or bfloat16; both exact)."""
    fmt = _check_pair(codes, scales)
    c2, s2 = codes.reshape(-1, fmt.dim), scales.reshape(-1, fmt.num_scales)
    return _decode(c2, s2, dtype).view(codes.shape)


def decode_window(
    packed: Tensor, *, dtype: torch.dtype = torch.float32, pending: list[PendingCheck] | None = None
) -> Tensor:
    """Fused unpack + dequantise (the cache read): entries → ``[..., dim]`` in ``dtype``.

    float32 output from CPU entries runs the compiled kernel (``native``) when available (same values, same
    errors). ``pending``: None raises on a scale byte outside `SCALE_BYTES` now (one host read on the pure-torch
    path); a list gets that check appended instead (`scales.check_scale_bytes`: no host read) and each scale
    byte is read clamped into `SCALE_BYTES` (finite values; the same values where every byte is in range)."""
    fmt = _entry_of(packed)
    rows = packed.reshape(-1, packed.shape[-1])
    kernels = native.fp4_kernels() if rows.device.type == "cpu" and dtype == torch.float32 else None
    if kernels is not None and rows.stride(-1) == 1:
        out = torch.empty(rows.shape[0], fmt.dim)
        if not rows.shape[0] or kernels.decode_fp8(rows, *SCALE_BYTES, out) < 0:
            return out.view(*packed.shape[:-1], fmt.dim)
    scales = check_scale_bytes(
        rows[:, fmt.dim :], SCALE_BYTES, name=_NAME, pending=pending
    )  # clamped if deferred
    out = _decode(rows[:, : fmt.dim], scales, dtype)
    return out.view(*packed.shape[:-1], fmt.dim)


def read_window(
    kv: Tensor, rings: Sequence[Tensor], slots: Tensor, held: Tensor | None, out: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """A decode step's window read in one compiled call, or None where `Codec.read_window`'s torch path runs.

    With ``e = encode_window(kv)``: keys fp32 ``[B, n+1, dim]``, ``keys[b, j] = decode_window(rings[b][slots[b,
    j]])`` where ``held[b, j]`` (every slot when ``held`` is None), else ``decode_window(e[b])``, and ``keys[b,
    n] = decode_window(e[b])``; and the entries to store, uint8 ``[B, 33·dim/32]``, ``encode_window(keys[:,
    n])``: the bits of that torch path (``fp8_kernels.cpp``, ``read_fp8_window``).

    Args:
        kv: float32 [B, dim] (dim a multiple of 32), the new window keys.
        rings: B rings, uint8 [W_b, 33·dim/32] each (row stride free, unit element stride).
        slots: int64 [B, n] contiguous, the ring rows to read, each in [0, W_b).
        held: bool [B, n] contiguous, or None.
        out: None, or a float32 [B, n+1, dim] contiguous CPU tensor to write the keys into (and return; another
            shape or layout is not used).

    None (nothing raised) when the kernels are not built (``native``) or the input is not what the kernel takes:
    another dtype, device or layout, a slot outside its ring, a non-finite ``kv`` row, a read entry with a scale
    byte outside `SCALE_BYTES`; the torch path then gives the same result or raises the error.
    """
    kernels = native.fp4_kernels()
    if (
        kernels is None or kv.dim() != 2 or slots.dim() != 2 or kv.is_neg()
    ):  # the kernel reads kv's raw storage
        return None
    if not (kv.is_cpu and slots.is_cpu and (held is None or held.is_cpu)):
        return None
    b, dim = kv.shape
    keys = native.kernel_output(out, (b, slots.shape[-1] + 1, dim))
    entries = torch.empty(b, dim + dim // _BLOCK, dtype=torch.uint8, device="cpu")
    if kernels.read_fp8_window(rings, slots, held, kv, *SCALE_BYTES, keys, entries):
        return keys, entries
    return None


def fake_quant_window(x: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``dequantize(quantize(x))`` in ``dtype``: what the quantised reference path sees."""
    return dequantize_window(*quantize_window(x), dtype=dtype)


def _decode(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    work = torch.empty(chunk_rows(*codes.shape) * codes.shape[1], dtype=torch.int16, device=codes.device)

    def fill(sl: slice, out: Tensor) -> None:
        dequantize_e4m3_chunk_(codes[sl], scales[sl], out, work, block=_BLOCK)

    return decode_rows(*codes.shape, fill, dtype=dtype, name=_NAME, device=codes.device)


def _check_pair(codes: Tensor, scales: Tensor) -> EntryFormat:
    return check_codes_and_scales(
        codes, scales, window_format, codes_dtype=torch.uint8, scale_bytes=SCALE_BYTES, name=_NAME
    )


@functools.cache
def _format(dim: int) -> tuple[EntryFormat, int]:
    """``(window_format(dim), its bytes per entry)``, built once per width: the format's sizes are properties, and
    a decode step encodes and decodes window entries four times per layer. An entry is the ``dim`` E4M3 bytes,
    then the ``dim/32`` scale bytes (no tail, no pad: the scales start at byte ``dim``).

    Raises:
        ValueError: ``dim`` is no window width (as `window_format`).
    """
    fmt = window_format(dim)
    assert fmt.scale_offset == fmt.dim and fmt.bytes_per_entry == fmt.dim + fmt.num_scales  # no tail, no pad
    return fmt, fmt.bytes_per_entry


def _entry_of(packed: Tensor) -> EntryFormat:
    return entry_of_packed(
        packed, lambda width: width * _BLOCK // (_BLOCK + 1), lambda dim: _format(dim)[0], name=_NAME
    )
