"""The model's linear layer in its three storages: dense, FP8 (32×32 tiles) and FP4 (MXFP4 experts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvdiet.model.gemv import ROWS_MAX, row_products
from kvdiet.model.linear import (
    Linear,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    fp8_activations,
    quantize_fp4_weight,
    quantize_fp8_weight,
    ue8m0_values,
)


def test_ue8m0_bytes_are_powers_of_two() -> None:
    raw = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    assert ue8m0_values(raw).tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.equal(ue8m0_values(raw.view(torch.float8_e8m0fnu)), ue8m0_values(raw))
    assert ue8m0_values(torch.tensor([0.25])).tolist() == [0.25]  # float scales are values
    with pytest.raises(ValueError, match="255"):
        ue8m0_values(torch.tensor([255], dtype=torch.uint8))


def test_fp8_weight_tiles_by_hand() -> None:
    # 2×3 tiles of 2×2: tile (0, 1) has scale 2^2, the rest 2^0; values exact in E4M3
    w = torch.tensor([[1.0, 2.0, 0.5], [3.0, -4.0, 0.25], [1.5, 6.0, -0.75]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 129], [127, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = torch.tensor([[1.0, 2.0, 2.0], [3.0, -4.0, 1.0], [1.5, 6.0, -0.75]])
    assert torch.equal(dequantize_fp8_weight(w, scale, block=2), want)


def test_fp4_weight_nibbles_and_scales_by_hand() -> None:
    # one row of 32 codes: byte = low nibble (even element) | high nibble << 4; code 9 = -0.5, 7 = 6.0
    codes = [1, 2, 9, 7] + [0] * 28  # 0.5, 1.0, -0.5, 6.0, zeros
    packed = torch.tensor([[codes[i] | codes[i + 1] << 4 for i in range(0, 32, 2)]], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2.0
    got = dequantize_fp4_weight(packed.view(torch.float4_e2m1fn_x2), scale)
    assert got[0, :4].tolist() == [1.0, 2.0, -1.0, 12.0] and not got[0, 4:].any()


@pytest.mark.parametrize("shape", [(64, 64), (70, 96), (1, 32)])
def test_weight_quantisers_round_trip(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q8, s8 = quantize_fp8_weight(w, block=32)
    assert q8.dtype == torch.float8_e4m3fn and tuple(s8.shape) == (-(-shape[0] // 32), -(-shape[1] // 32))
    d8 = dequantize_fp8_weight(q8, s8, block=32)
    assert (d8 - w).abs().max() <= w.abs().max() / 16  # half an E4M3 step of the tile's top binade
    assert torch.equal(dequantize_fp8_weight(*quantize_fp8_weight(d8, block=32), block=32), d8)  # idempotent
    q4, s4 = quantize_fp4_weight(w)
    assert q4.dtype == torch.float4_e2m1fn_x2 and tuple(q4.shape) == (shape[0], shape[1] // 2)
    d4 = dequantize_fp4_weight(q4, s4)
    assert torch.equal(dequantize_fp4_weight(*quantize_fp4_weight(d4)), d4)
    assert (d4 - w).abs().max() <= w.abs().max() / 3


def test_fp8_activations_follow_the_reference_recipe() -> None:
    # block amax 0.9 → scale 2^ceil(log2(0.9/448)) = 2^-8; 0.9·256 = 230.4 → E4M3 224 (step 16) = 0.875;
    # 0.30078125·256 = 77 → 80 (step 8) = 0.3125; a second block of 0.001 keeps its own, finer scale
    x = torch.zeros(64)
    x[0], x[1], x[2], x[32] = 0.9, 0.30078125, -1e-9, 0.001
    got = fp8_activations(x)
    assert got[:3].tolist() == [0.875, 0.3125, 0.0]
    assert got[32].item() == pytest.approx(0.001, rel=1 / 16)
    with pytest.raises(ValueError):
        fp8_activations(torch.zeros(3, 40))  # not a multiple of 32


def test_linear_storages_compute_as_documented() -> None:
    """Each storage's product: a few rows (a decode step's) in `kvdiet.model.gemv`'s order, more in the BLAS's."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * 0.1
    cases = ((5, row_products), (ROWS_MAX + 1, F.linear))
    for rows, product in cases:
        x = torch.randn(rows, 64, generator=gen)
        lin = Linear(64, 48)
        lin.set_weight(w.to(torch.bfloat16))
        assert lin.storage == "dense" and lin.scale is None
        assert torch.equal(lin(x), product(x, w.to(torch.bfloat16).float()))
        q, s = quantize_fp8_weight(w, block=32)
        lin.set_weight(q, s, block=32)
        assert lin.storage == "fp8" and set(lin.state_dict()) == {"weight", "scale"}
        want = product(fp8_activations(x), dequantize_fp8_weight(q, s, block=32))
        assert torch.equal(lin(x), want)
        q4, s4 = quantize_fp4_weight(w)
        for stored in (q4, q4.view(torch.uint8), q4.view(torch.int8)):  # F4, or nibbles in U8/I8
            lin.set_weight(stored, s4)
            assert lin.storage == "fp4"
            assert torch.equal(lin(x), product(fp8_activations(x), dequantize_fp4_weight(q4, s4)))


def test_set_weight_refuses_shapes_that_do_not_fit() -> None:
    lin = Linear(64, 48)
    q4, s4 = quantize_fp4_weight(torch.randn(48, 64))
    with pytest.raises(ValueError, match=r"fp4 weight needs a scale of shape \(48, 2\)"):
        lin.set_weight(q4, s4[:, :1])
    with pytest.raises(ValueError, match=r"dense weight has shape \(64, 48\), expected \(48, 64\)"):
        lin.set_weight(torch.zeros(64, 48))
    with pytest.raises(ValueError, match="FP4 weights need in_features divisible by 32"):
        Linear(40, 8).stored_shapes("fp4")
    assert lin.storage == "dense"  # unchanged after the refusals
