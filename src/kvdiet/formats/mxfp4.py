"""Index key entry ``mxfp4``: E2M1 values, one UE8M0 (power-of-two) scale per 32 values.

Recipe (v41-spec §5.1, DeepSeek reference kernel ``fp4_act_quant(x, 32)``), per block of 32, in fp32::

    amax = max(max|x|, 6·2^-126);  s = 2^ceil(log2(amax / 6));  q = RNE_e2m1(clamp(x / s, ±6))

The ceil is taken on the exact fp32 bits of ``amax / 6`` (see ``scales.ue8m0_scale``). It shares the E2M1
encoder and the block codec of ``fp4`` (only the scale recipe differs), so both FP4 formats round and pack
identically (cases B12, B17).

Entry (v41-spec §4, §5.2): 128 values → 64 B of nibbles (low nibble = even element) + 4 UE8M0 bytes = 68 B
(``layout.index_key_format``). Shapes: ``x`` float32/bfloat16/float16 ``[..., dim]`` (dim a multiple of 32,
any leading dims); codes uint8 ``[..., dim]`` (0..15); scales uint8 ``[..., dim/32]`` (byte = exponent +
127, written range 1..252); packed uint8 ``[..., 17·dim/32]``; values float32 ``[..., dim]``, or bfloat16
with ``dtype=`` (exact either way).

Edge cases:
- all-zero block: sentinel scale 2^-126 (byte 0x01), dequantises to exactly 0.
- tiny values keep their relative precision down to the fp32 normal range: a block of 1e-30 gets
  ``s = 2^-102`` and stays finite and non-zero; only ``|x| ≤ 2^-128`` (a quarter of the smallest scale)
  flushes to ±0. Dequantised values can be fp32 subnormals (``0.5 · 2^-126``).
- huge values: the scale exponent is capped at 125 so ``6·s`` stays finite; a block with amax above
  ``6·2^125 ≈ 2.55e38`` saturates to ``±6·2^125`` (REF would dequantise such a block to inf). 1e38 is
  unaffected and finite.
- ±inf / NaN input: ``ValueError``.
- error: ``|x − v| ≤ s·step/2`` (step 0.5/1/2 for ``|x|/s`` in [0,2]/[2,4]/[4,6]); ``amax/s`` lies in
  (3, 6], so nothing saturates below the cap.
- idempotence: ``dequantize(quantize(dequantize(q)))`` equals ``dequantize(q)`` bit for bit for every
  valid ``(codes, scales)``: the new scale is ``s·2^-j`` and E2M1 values times ``2^j`` stay on the grid up
  to 6. Codes stay the same iff the block's top value is 4 or 6 (or ``s`` is the 2^-126 floor); from
  ``quantize`` only a top value of 3 (``amax/s`` in (3, 3.5)) rescales: ``s/2`` with doubled values.

Errors: ``ValueError`` for a dtype other than float32/bfloat16/float16, a last dim not a multiple of 32,
non-finite input, codes/scales/packed of the wrong dtype or width, codes above 15, or a scale byte outside
1..252.
"""

from __future__ import annotations

import torch

from kvdiet.formats import native
from kvdiet.formats.fp4 import (
    Fp4Recipe,
    decode_fp4,
    dequantize_fp4,
    encode_fp4,
    pack_fp4,
    quantize_fp4,
    unpack_fp4,
)
from kvdiet.formats.layout import index_key_format
from kvdiet.formats.scales import PendingCheck, ue8m0_scale, ue8m0_to_float

__all__ = [
    "INDEX_KEY",
    "decode_index_key",
    "dequantize_index_key",
    "encode_index_key",
    "fake_quant_index_key",
    "pack_index_key",
    "quantize_index_key",
    "unpack_index_key",
]

Tensor = torch.Tensor


_MAX_EXPONENT = 125  # 6 · 2^125 ≈ 2.55e38 is the largest finite dequantised value


def _index_key_scale(amax: Tensor) -> tuple[Tensor, Tensor]:
    return ue8m0_scale(amax.clamp_(min=6 * 2.0**-126) / 6, max_exponent=_MAX_EXPONENT)


# Stored bytes 1 (2^-126, the amax floor) .. 252 (2^125, the cap).
INDEX_KEY = Fp4Recipe(
    "mxfp4",
    32,
    index_key_format,
    (1, _MAX_EXPONENT + 127),
    _index_key_scale,
    ue8m0_to_float,
    native.RECIPE_UE8M0X32,
)


def quantize_index_key(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., dim]`` → (codes uint8 ``[..., dim]``, UE8M0 scale bytes uint8 ``[..., dim/32]``)."""
    return quantize_fp4(x, recipe=INDEX_KEY)


def dequantize_index_key(codes: Tensor, scales: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """(codes, UE8M0 scale bytes) → ``[..., dim]`` in ``dtype`` (float32 or bfloat16; both exact)."""
    return dequantize_fp4(codes, scales, recipe=INDEX_KEY, dtype=dtype)


def pack_index_key(codes: Tensor, scales: Tensor) -> Tensor:
    """(codes, scale bytes) → 68-B entries (dim 128): uint8 ``[..., dim/2 + dim/32]``."""
    return pack_fp4(codes, scales, recipe=INDEX_KEY)


def unpack_index_key(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Entries uint8 ``[..., dim/2 + dim/32]`` → (codes, scale bytes)."""
    return unpack_fp4(packed, recipe=INDEX_KEY)


def encode_index_key(x: Tensor, *, pending: list[PendingCheck] | None = None) -> Tensor:
    """Fused quantise + pack (the cache write): ``x [..., dim]`` → entries uint8 ``[..., 17·dim/32]``
    (``pending``: `fp4.encode_fp4`)."""
    return encode_fp4(x, recipe=INDEX_KEY, pending=pending)


def decode_index_key(
    packed: Tensor, *, dtype: torch.dtype = torch.float32, pending: list[PendingCheck] | None = None
) -> Tensor:
    """Fused unpack + dequantise (the cache read): entries → ``[..., dim]`` in ``dtype`` (``pending``:
    `fp4.decode_fp4`)."""
    return decode_fp4(packed, recipe=INDEX_KEY, dtype=dtype, pending=pending)


def fake_quant_index_key(x: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """``dequantize(quantize(x))`` in ``dtype``: what the quantised reference path sees."""
    return dequantize_index_key(*quantize_index_key(x), dtype=dtype)
