"""The two FP4 formats: main KV (E4M3 scale per 16) and index keys (UE8M0 scale per 32).

Golden entries, the B12 ties table through both formats, scale edge cases (B15) and the documented
idempotence domains.
"""

from __future__ import annotations

import pytest
import torch

from kvdiet.formats.e2m1 import DECODE_TABLE
from kvdiet.formats.fp4 import (
    decode_main_kv,
    dequantize_main_kv,
    encode_main_kv,
    fake_quant_main_kv,
    pack_main_kv,
    quantize_main_kv,
    unpack_main_kv,
)
from kvdiet.formats.mxfp4 import (
    dequantize_index_key,
    encode_index_key,
    fake_quant_index_key,
    pack_index_key,
    quantize_index_key,
    unpack_index_key,
)

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]  # 6.0 makes amax/6 = 1, so the scale is exactly 1
TIES_ROUNDED = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
# block A (scale 2): code of x/2 for each value; block B (scale 1.5, a non-power-of-two E4M3 scale)
BLOCK_A = [12.0, -12.0, 1.5, -0.5, 10.0, 2.5, 7.0, -5.0, 0.0, 1.0, 3.0, 4.0, 6.0, 8.0, -2.0, -6.0]
BLOCK_A_BYTES = [0xF7, 0x82, 0x26, 0xC6, 0x10, 0x43, 0x65, 0xDA]
BLOCK_B = [9.0, 4.5, 2.25, -0.375, 1.125, 3.75, 5.25, 7.5] + [0.0] * 8
BLOCK_B_BYTES = [0x57, 0x83, 0x42, 0x66, 0, 0, 0, 0]

pytestmark = pytest.mark.usefixtures("format_backend")  # compiled kernels and pure torch


def test_main_kv_golden_entry():
    x = torch.tensor(BLOCK_A + BLOCK_B)
    packed = encode_main_kv(x)
    assert packed.tolist() == BLOCK_A_BYTES + BLOCK_B_BYTES + [0x40, 0x3C]  # E4M3 2.0, 1.5
    assert torch.equal(pack_main_kv(*quantize_main_kv(x)), packed)
    assert decode_main_kv(packed).tolist() == [
        *[12.0, -12.0, 2.0, -0.0, 8.0, 2.0, 8.0, -4.0, 0.0, 1.0, 3.0, 4.0, 6.0, 8.0, -2.0, -6.0],
        *[9.0, 4.5, 2.25, -0.0, 1.5, 3.0, 6.0, 6.0] + [0.0] * 8,
    ]


def test_index_key_golden_entry():
    x = torch.tensor(BLOCK_A + [0.0] * 16)  # amax 12: 12/6 = 2 = 2^1 exactly -> byte 127 + 1
    packed = encode_index_key(x)
    assert packed.tolist() == BLOCK_A_BYTES + [0] * 8 + [0x80]
    assert torch.equal(pack_index_key(*quantize_index_key(x)), packed)
    # amax 10: 10/6 -> 2^ceil(log2 1.67) = 2, and 10/2 = 5 is a tie -> 4
    codes, scales = quantize_index_key(torch.tensor([10.0] + [0.0] * 31))
    assert scales.tolist() == [128] and codes[0].item() == 6


@pytest.mark.parametrize(
    ("quantize", "dequantize", "block"),
    [(quantize_main_kv, dequantize_main_kv, 16), (quantize_index_key, dequantize_index_key, 32)],
)
def test_ties_to_even_through_both_formats_at_scale_one(quantize, dequantize, block):  # B12
    half = TIES + [-t for t in TIES]
    x = torch.tensor((half * 2)[:block])
    codes, scales = quantize(x)
    assert scales.tolist() == [0x38 if block == 16 else 127]  # E4M3 1.0 / UE8M0 2^0
    assert codes.tolist() == ([0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15] * 2)[:block]
    signed = TIES_ROUNDED + [-t for t in TIES_ROUNDED]
    assert dequantize(codes, scales).tolist() == (signed * 2)[:block]


def test_main_kv_scale_is_a_true_division_by_six():
    # amax just below 57/64: amax / 6 rounds below the E4M3 midpoint 0.1484375 -> byte 0x21 (0.140625);
    # amax * fp32(1/6) would land on the midpoint and round to even, byte 0x22 (0.15625)
    amax = torch.nextafter(torch.tensor(0.890625), torch.tensor(0.0)).item()
    _, scales = quantize_main_kv(torch.tensor([amax] + [0.0] * 15))
    assert scales.tolist() == [0x21]


def test_main_kv_saturates_above_2688():
    x = torch.tensor([3000.0, -5000.0, 2688.0, 1.0] + [0.0] * 12)
    codes, scales = quantize_main_kv(x)
    assert scales.tolist() == [0x7E]  # 448
    assert dequantize_main_kv(codes, scales)[:4].tolist() == [2688.0, -2688.0, 2688.0, 0.0]


def test_main_kv_subnormal_scale_can_saturate_the_block_max():
    # amax/6 = 1.4·2^-9 rounds down to the E4M3 subnormal 2^-9, so amax/s = 8.4 saturates to 6
    amax = 6 * 1.4 * 2.0**-9
    codes, scales = quantize_main_kv(torch.tensor([amax] + [0.0] * 15))
    assert scales.tolist() == [0x01]
    assert dequantize_main_kv(codes, scales)[0].item() == 6 * 2.0**-9


@pytest.mark.parametrize(
    ("values", "scale_byte", "expected"),
    [
        ([0.0] * 16, 0x01, [0.0] * 16),  # all zero -> sentinel 2^-9, exact zeros
        ([1e-30] * 16, 0x01, [0.0] * 16),  # tiny flushes to 0 (documented)
        ([1e38] + [1.0] * 15, 0x7E, [2688.0] + [0.0] * 15),  # saturates, finite
    ],
)
def test_main_kv_b15_blocks(values, scale_byte, expected):
    codes, scales = quantize_main_kv(torch.tensor(values))
    assert scales.tolist() == [scale_byte]
    assert dequantize_main_kv(codes, scales).tolist() == expected


def test_index_key_b15_blocks():
    codes, scales = quantize_index_key(torch.zeros(32))
    assert scales.tolist() == [1] and dequantize_index_key(codes, scales).tolist() == [0.0] * 32
    codes, scales = quantize_index_key(torch.full((32,), 1e-30))  # keeps relative precision
    assert scales.tolist() == [127 - 102]
    assert dequantize_index_key(codes, scales).tolist() == [6 * 2.0**-102] * 32
    codes, scales = quantize_index_key(torch.tensor([1e38] + [1.0] * 31))  # 1e38/6 -> 2^124; 4.7 -> 4
    assert scales.tolist() == [127 + 124]
    assert dequantize_index_key(codes, scales)[:2].tolist() == [4 * 2.0**124, 0.0]
    big = torch.finfo(torch.float32).max  # above 6·2^125 the cap keeps 6·s finite
    codes, scales = quantize_index_key(torch.tensor([big, -big] + [0.0] * 30))
    assert scales.tolist() == [252]
    assert dequantize_index_key(codes, scales)[:2].tolist() == [6 * 2.0**125, -6 * 2.0**125]


def test_main_kv_idempotence_domain():
    grid = torch.tensor(DECODE_TABLE[:8])
    failures = set()
    for scale_byte in range(0x01, 0x7F):
        for top in range(1, 8):  # block: every magnitude up to `top`, both signs
            mags = torch.arange(top + 1, dtype=torch.uint8)
            codes = torch.cat([mags, mags | 8, torch.full((14 - 2 * top,), top, dtype=torch.uint8)])
            scales = torch.tensor([scale_byte], dtype=torch.uint8)
            v = dequantize_main_kv(codes, scales)
            c2, s2 = quantize_main_kv(v)
            if top == 7:  # a ±6 code pins the scale: codes and values come back unchanged
                assert torch.equal(c2, codes) and torch.equal(s2, scales), (scale_byte, top)
            if not torch.equal(dequantize_main_kv(c2, s2), v):
                failures.add((scale_byte, top))
    assert all(top < 7 for _, top in failures)
    assert (0x02, 6) in failures  # s = 2^-8, top value 4·2^-8 = 2^-6 -> requantises to 6·2^-9
    # quantize() output with a normal scale (amax >= 45·2^-9) always holds a ±6 code
    x = torch.randn(2000, 16, generator=torch.Generator().manual_seed(0))
    amax = torch.logspace(-1.05, 3.5, 2000).unsqueeze(1)
    amax[0] = 45 * 2.0**-9  # the smallest amax whose scale rounds to the normal 2^-6
    x = x / x.abs().amax(-1, keepdim=True) * amax
    codes, scales = quantize_main_kv(x)
    assert int(scales.min()) == 0x08
    assert bool(((codes & 7).amax(-1) == 7).all())
    v = dequantize_main_kv(codes, scales)
    assert torch.equal(fake_quant_main_kv(v), v) and grid[7] == 6.0


def test_index_key_value_idempotent_codes_rescale_when_top_is_three():
    for scale_byte in (1, 2, 100, 127, 200, 252):
        for top in range(1, 8):
            mags = torch.arange(top + 1, dtype=torch.uint8)
            codes = torch.cat([mags, mags | 8, torch.full((30 - 2 * top,), top, dtype=torch.uint8)])
            scales = torch.tensor([scale_byte], dtype=torch.uint8)
            v = dequantize_index_key(codes, scales)
            c2, s2 = quantize_index_key(v)
            assert torch.equal(dequantize_index_key(c2, s2), v), (scale_byte, top)
            same_codes = top >= 6 or scale_byte == 1  # top value 4 or 6, or the 2^-126 floor
            assert torch.equal(c2, codes) == same_codes, (scale_byte, top)
    x = (
        torch.randn(500, 32, generator=torch.Generator().manual_seed(1))
        * torch.logspace(-30, 30, 500)[:, None]
    )
    v = fake_quant_index_key(x)
    assert torch.equal(fake_quant_index_key(v), v)


def test_unpack_gives_back_codes_and_scales():
    x = torch.randn(4, 3, 512, generator=torch.Generator().manual_seed(2))
    codes, scales = quantize_main_kv(x)
    packed = pack_main_kv(codes, scales)
    assert packed.shape == (4, 3, 288)
    c2, s2 = unpack_main_kv(packed)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
    assert torch.equal(packed[..., 256:], scales)
    codes, scales = quantize_index_key(x.view(4, 12, 128))
    c2, s2 = unpack_index_key(pack_index_key(codes, scales))
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
