"""E2M1 encoder, decoder and nibble packing (cases B12, B17): golden values and a float64 reference."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvdiet.formats.e2m1 import (
    DECODE_TABLE,
    E2M1_GRID,
    decode_e2m1,
    decode_packed_,
    encode_e2m1,
    encode_e2m1_,
    pack_codes_,
    pack_nibbles,
    pair_table,
    unpack_nibbles,
)

GOLDEN_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def reference_code(v: float) -> int:
    """Plain float64 E2M1: clamp to ±6, nearest grid magnitude, ties to the even index; sign in bit 3."""
    mag = min(abs(v), 6.0)
    dist = [abs(mag - g) for g in E2M1_GRID]
    best = min(dist)
    index = min(i for i, d in enumerate(dist) if d == best and (dist.count(best) == 1 or i % 2 == 0))
    return index | (8 if math.copysign(1.0, v) < 0 else 0)


def test_pack_nibbles_golden_bytes_low_nibble_is_even_element():  # B17
    packed = pack_nibbles(torch.arange(16, dtype=torch.uint8))
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert unpack_nibbles(packed).tolist() == list(range(16))


def test_decode_table_golden_including_negative_zero():  # B17
    values = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert values.dtype == torch.float32
    assert values.tolist() == GOLDEN_VALUES
    assert list(DECODE_TABLE) == GOLDEN_VALUES
    assert torch.signbit(values).tolist() == [False] * 8 + [True] * 8  # code 8 is -0.0


def test_ties_to_even_table_and_saturation():  # B12, raw encoder at scale 1
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor(ties + [-t for t in ties] + [6.5, 100.0, -100.0])
    codes = encode_e2m1(x)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 7, 7, 15]
    assert decode_e2m1(codes).tolist() == expected + [-e for e in expected] + [6.0, 6.0, -6.0]


def test_negative_zero_and_small_negatives_keep_the_sign():
    codes = encode_e2m1(torch.tensor([0.0, -0.0, -0.1, 0.1, -0.25, 1e-30, -1e-30]))
    assert codes.tolist() == [0, 8, 8, 0, 8, 0, 8]
    assert encode_e2m1(decode_e2m1(torch.tensor([8], dtype=torch.uint8))).tolist() == [8]


def test_encoder_matches_float64_reference_at_every_boundary():
    # grid points, midpoints and their fp32 neighbours, in every binade, both signs, plus saturating values
    points = [*E2M1_GRID, *((a + b) / 2 for a, b in itertools.pairwise(E2M1_GRID))]
    points += [6.5, 7.0, 8.0, 1e3, 3.0e38, 1e-40, 2.0**-149]
    x32 = torch.tensor(points, dtype=torch.float32)
    near = torch.cat([x32, torch.nextafter(x32, torch.tensor(0.0)), torch.nextafter(x32, torch.tensor(1e9))])
    near = torch.cat([near, -near, torch.rand(4000) * 16 - 8])
    expected = [reference_code(v) for v in near.double().tolist()]
    assert encode_e2m1(near).tolist() == expected


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-1e6, 1e6, width=32)))
def test_encoder_property_matches_reference(values):
    expected = [reference_code(v) for v in values.astype(np.float64).tolist()]
    assert encode_e2m1(torch.from_numpy(values)).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encoder_accepts_half_precision_inputs(dtype):
    x = torch.tensor([0.25, 0.75, -5.0, 6.0, 100.0], dtype=dtype)
    assert encode_e2m1(x).tolist() == [0, 2, 14, 7, 7]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_encoder_rejects_non_finite(bad):
    with pytest.raises(ValueError, match="non-finite"):
        encode_e2m1(torch.tensor([1.0, bad]))


def test_encoder_rejects_integer_input():
    with pytest.raises(ValueError, match="dtype"):
        encode_e2m1(torch.tensor([1, 2]))


def test_pack_and_decode_reject_bad_codes():
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_nibbles(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_nibbles(torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.tensor([3, 1, 2], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        decode_e2m1(torch.tensor([200], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_nibbles(torch.tensor([1], dtype=torch.int16))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=3),
    st.integers(1, 20),
    st.randoms(use_true_random=False),
)
def test_pack_unpack_round_trip_any_leading_dims(lead, pairs, rnd):
    codes = torch.tensor([rnd.randrange(16) for _ in range(math.prod(lead) * 2 * pairs)], dtype=torch.uint8)
    codes = codes.view(*lead, 2 * pairs)
    packed = pack_nibbles(codes)
    assert packed.shape == (*lead, pairs)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(packed & 0x0F, codes[..., 0::2]) and torch.equal(packed >> 4, codes[..., 1::2])


def test_fast_paths_match_plain_ones():
    y = torch.randn(8, 64) * 4
    expected = encode_e2m1(y)
    work = torch.empty(2 * y.numel(), dtype=torch.int32)
    codes = encode_e2m1_(y.clone(), work)
    assert torch.equal(codes.to(torch.uint8), expected)
    out = torch.empty(8, 32, dtype=torch.uint8)
    pack_codes_(codes, out, work)
    assert torch.equal(out, pack_nibbles(expected))
    values = torch.empty(8, 64)
    decode_packed_(out, values, pair_table())
    assert torch.equal(values, decode_e2m1(expected))
