"""The FP8 formats: window entries (MXFP8, UE8M0 per 32) and the V4 record (per 64, RoPE tail in bf16)."""

from __future__ import annotations

import pytest
import torch

from kvdiet.formats.fp8 import (
    decode_window,
    dequantize_window,
    encode_window,
    fake_quant_window,
    pack_window,
    quantize_window,
    unpack_window,
)
from kvdiet.formats.layout import v4_record_format
from kvdiet.formats.v4_record import (
    decode_v4_record,
    dequantize_v4_record,
    encode_v4_record,
    fake_quant_v4_record,
    pack_v4_record,
    quantize_v4_record,
    unpack_v4_record,
)

# amax 1.0 -> s = 2^ceil(log2(1/448)) = 2^-8 (byte 119); each value times 256, then E4M3 round-to-nearest-even
GOLDEN = [1.0, -0.5, 0.001, 2.0**-17, 2.0**-18, 3 * 2.0**-18, 0.3, -0.3, 0.9, 17 / 256]
GOLDEN_CODES = [0x78, 0xF0, 0x28, 0x01, 0x00, 0x02, 0x6A, 0xEA, 0x76, 0x58]
GOLDEN_VALUES = [1.0, -0.5, 2.0**-10, 2.0**-17, 0.0, 2.0**-16, 0.3125, -0.3125, 0.875, 0.0625]
ROPE = [1.0, -2.0, 0.5, 3.0, -0.0, 1.5, 0.1, -1e38]
ROPE_BYTES = [0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x40, 0x40, 0x00, 0x80, 0xC0, 0x3F, 0xCD, 0x3D, 0x96, 0xFE]


def test_window_golden_entry():
    x = torch.tensor(GOLDEN + [0.0] * 22)
    packed = encode_window(x)
    assert packed.tolist() == GOLDEN_CODES + [0] * 22 + [119]
    assert torch.equal(pack_window(*quantize_window(x)), packed)
    assert decode_window(packed).tolist() == GOLDEN_VALUES + [0.0] * 22


def test_v4_record_golden_entry():
    x = torch.tensor(GOLDEN + [0.0] * 54 + ROPE)
    fmt = v4_record_format(72, 8)
    packed = encode_v4_record(x, rope_dim=8)
    assert packed.shape == (fmt.bytes_per_entry,) == (88,)
    assert packed.tolist() == GOLDEN_CODES + [0] * 54 + ROPE_BYTES + [119] + [0] * 7
    assert torch.equal(pack_v4_record(*quantize_v4_record(x, rope_dim=8), rope_dim=8), packed)
    rope_back = [1.0, -2.0, 0.5, 3.0, -0.0, 1.5, 0.10009765625, -9.969209968386869e37]
    assert decode_v4_record(packed, rope_dim=8).tolist() == GOLDEN_VALUES + [0.0] * 54 + rope_back


def test_v4_record_584_byte_layout():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    packed = encode_v4_record(x)
    assert packed.shape == (3, 584)
    codes, scales = quantize_v4_record(x)
    assert torch.equal(packed[:, :448].to(torch.int16), codes[:, :448])
    assert torch.equal(packed[:, 448:576].contiguous().view(torch.bfloat16), x[:, 448:].bfloat16())
    assert torch.equal(packed[:, 576:583], scales) and packed[:, 583].tolist() == [0, 0, 0]
    c2, s2 = unpack_v4_record(packed)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)


def test_e4m3_decode_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.full((8, 1), 127, dtype=torch.uint8)
    values = dequantize_window(codes, scales)
    reference = codes.view(torch.float8_e4m3fn).float()
    finite = ~reference.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(values[finite], reference[finite])
    assert values.flatten()[[0x7F, 0xFF]].tolist() == [480.0, -480.0]  # never written; documented


def test_window_b15_blocks():
    codes, scales = quantize_window(torch.zeros(32))
    assert scales.tolist() == [105] and dequantize_window(codes, scales).tolist() == [0.0] * 32
    codes, scales = quantize_window(torch.full((32,), 1e-30))  # below 2^-10·2^-22: flushes to 0
    assert scales.tolist() == [105] and dequantize_window(codes, scales).tolist() == [0.0] * 32
    codes, scales = quantize_window(torch.tensor([1e38] + [1.0] * 31))  # 1e38/448 -> 2^118; 300.9 -> 288
    assert scales.tolist() == [127 + 118]
    assert dequantize_window(codes, scales)[:2].tolist() == [288 * 2.0**118, 0.0]
    big = torch.finfo(torch.float32).max  # REF: 2^120 and q = 256 -> inf; capped at 2^119 -> 448·2^119
    codes, scales = quantize_window(torch.tensor([big, -big] + [0.0] * 30))
    assert scales.tolist() == [127 + 119]
    assert dequantize_window(codes, scales)[:2].tolist() == [448 * 2.0**119, -448 * 2.0**119]


def test_v4_rope_tail_saturates_and_rejects_non_finite():
    x = torch.zeros(128)
    x[64:66] = torch.tensor([3.4e38, -3.4e38])
    assert fake_quant_v4_record(x)[64:66].tolist() == [
        torch.finfo(torch.bfloat16).max,
        -torch.finfo(torch.bfloat16).max,
    ]
    x[70] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_v4_record(x)


def test_value_idempotent_codes_rescale_when_top_is_224():
    for scale_byte in (105, 106, 127, 200, 246):
        for top in (0x30, 0x67, 0x68, 0x69, 0x76, 0x77, 0x7E):  # 0x76 = 224, 0x77 = 240, 0x7E = 448
            rest = [m | (0x80 * (m % 2)) for m in range(top + 1)]  # every magnitude up to top, both signs
            rest += [0] * (-len(rest) % 30)
            block = torch.tensor(
                [[top, top | 0x80, *rest[i : i + 30]] for i in range(0, len(rest), 30)], dtype=torch.uint8
            )
            scales = torch.full((block.shape[0], 1), scale_byte, dtype=torch.uint8)
            v = dequantize_window(block, scales)
            c2, s2 = quantize_window(v)
            assert torch.equal(dequantize_window(c2, s2), v), (scale_byte, top)
            assert torch.equal(c2, block) == (top > 0x76 or scale_byte == 105), (scale_byte, top)
    x = (
        torch.randn(400, 128, generator=torch.Generator().manual_seed(3))
        * torch.logspace(-6, 30, 400)[:, None]
    )
    v = fake_quant_window(x)
    assert torch.equal(fake_quant_window(v), v)
    v4 = fake_quant_v4_record(x)
    assert torch.equal(fake_quant_v4_record(v4), v4)


def test_unpack_window_gives_back_codes_and_scales():
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(4))
    codes, scales = quantize_window(x)
    packed = pack_window(codes, scales)
    assert packed.shape == (2, 5, 528) and torch.equal(packed[..., :512], codes)
    c2, s2 = unpack_window(packed)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)


def test_v4_record_rejects_bad_codes_and_dims():
    codes, scales = quantize_v4_record(torch.randn(512))
    codes[0] = 300
    with pytest.raises(ValueError, match=r"0\.\.255"):
        pack_v4_record(codes, scales)
    with pytest.raises(ValueError, match="dim 96 minus rope_dim 64"):
        quantize_v4_record(torch.randn(96))  # 96 - 64 = 32 is not a multiple of 64
    with pytest.raises(ValueError, match="583 B is not an entry width"):
        decode_v4_record(torch.zeros(583, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int16"):
        dequantize_v4_record(codes.to(torch.int32), scales)
