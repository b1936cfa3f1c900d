"""Promises every packed format keeps, parametrised over the four formats.

Widths from ``layout``, exact round trips, the error bound, sign symmetry, shapes and dtypes, errors, and the
B15 scale cases.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvdiet.formats import fp4, fp8, layout, mxfp4, scales, v4_record
from kvdiet.formats.layout import EntryFormat
from kvdiet.host_reads import HostReads

pytestmark = pytest.mark.usefixtures("format_backend")  # compiled kernels and pure torch


@dataclass(frozen=True)
class Fmt:
    """One format under test; for ``v4_record`` the RoPE tail is 64 values (0 below dim 128)."""

    name: str
    module: ModuleType
    suffix: str
    entry: Callable[[int], EntryFormat]
    block: int
    sign: int  # code bit that holds the sign

    def kw(self, dim: int) -> dict:
        return {"rope_dim": 64 if dim >= 128 else 0} if self.suffix == "v4_record" else {}

    def fn(self, op: str, dim: int) -> Callable:
        f = getattr(self.module, f"{op}_{self.suffix}")
        return lambda *args, **kwargs: f(*args, **kwargs, **self.kw(dim))

    def layout(self, dim: int) -> EntryFormat:
        return self.entry(dim, **self.kw(dim))


FORMATS = [
    Fmt("fp4_e2m1_e4m3x16", fp4, "main_kv", layout.main_kv_format, 16, 8),
    Fmt("mxfp4", mxfp4, "index_key", layout.index_key_format, 32, 8),
    Fmt("mxfp8", fp8, "window", layout.window_format, 32, 0x80),
    Fmt("v4_fp8_record", v4_record, "v4_record", layout.v4_record_format, 64, 0x80),
]
SMALL_DIM = {"main_kv": 32, "index_key": 64, "window": 64, "v4_record": 128}
by_name = pytest.mark.parametrize("f", FORMATS, ids=lambda f: f.name)


def scale_values(f: Fmt, scale_bytes: torch.Tensor) -> torch.Tensor:
    if f.suffix == "main_kv":
        return scale_bytes.view(torch.float8_e4m3fn).double()
    return torch.exp2(scale_bytes.double() - 127)


def error_bound(f: Fmt, x: torch.Tensor, codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Largest allowed |x − v| per value (float64): half a grid step × s, or the saturation distance."""
    x = x.double()
    q = x.shape[-1] - f.kw(x.shape[-1]).get("rope_dim", 0)
    s = scale_values(f, scale_bytes).repeat_interleave(f.block, dim=-1)
    y = x[..., :q].abs() / s
    if f.suffix in ("main_kv", "index_key"):
        top = 6.0
        half = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0)) * s
    else:
        top = 448.0
        half = torch.maximum(y * 2.0**-4, torch.full_like(y, 2.0**-10)) * s
    bound = torch.where(y > top, x[..., :q].abs() - top * s, half)
    rope = torch.maximum(x[..., q:].abs() * 2.0**-8, torch.full_like(x[..., q:], 2.0**-134))
    return torch.cat([bound, rope], dim=-1) * (1 + 1e-12)


@by_name
@pytest.mark.parametrize("dim", [512, 128, 64, 32])
def test_packed_width_is_the_layout_width(f, dim):
    if f.suffix == "v4_record" and dim == 32:
        with pytest.raises(ValueError, match="dim 32 minus rope_dim 0"):
            f.fn("encode", dim)(torch.randn(dim))
        return
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(dim))
    packed = f.fn("encode", dim)(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, f.layout(dim).bytes_per_entry)
    assert torch.equal(f.fn("pack", dim)(*f.fn("quantize", dim)(x)), packed)
    assert f.layout(dim).name == f.name
    assert {512: {"main_kv": 288, "index_key": 272, "window": 528, "v4_record": 584}}.get(dim, {}).get(
        f.suffix, packed.shape[-1]
    ) == packed.shape[-1]
    assert layout.index_key_format(128).bytes_per_entry == 68


@by_name
@settings(max_examples=50, deadline=None)
@given(
    lead=st.lists(st.integers(0, 2), max_size=2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_round_trips_error_bound_and_sign_symmetry(f, lead, dtype, data):
    dim = SMALL_DIM[f.suffix]
    n = int(np.prod(lead, dtype=np.int64)) * dim
    limit = torch.finfo(dtype).max  # every value stays finite in the input dtype
    values = data.draw(hnp.arrays(np.float32, n, elements=st.floats(-limit, limit, width=32)))
    x = torch.from_numpy(values).view(*lead, dim).to(dtype)
    quantize, dequantize = f.fn("quantize", dim), f.fn("dequantize", dim)
    codes, scale_bytes = quantize(x)
    packed = f.fn("pack", dim)(codes, scale_bytes)
    assert packed.shape == (*lead, f.layout(dim).bytes_per_entry)
    c2, s2 = f.fn("unpack", dim)(packed)
    assert torch.equal(c2, codes) and torch.equal(s2, scale_bytes)
    assert torch.equal(f.fn("encode", dim)(x), packed)
    v = dequantize(codes, scale_bytes)
    assert v.dtype == torch.float32 and v.shape == x.shape and bool(v.isfinite().all())
    assert torch.equal(f.fn("decode", dim)(packed), v)
    assert torch.equal(f.fn("fake_quant", dim)(x), v)
    assert torch.equal(dequantize(codes, scale_bytes, dtype=torch.bfloat16).float(), v)  # bf16 is exact
    assert torch.equal(quantize(x.float())[0], codes)  # half inputs quantise like their exact fp32 value
    assert bool(((x.double() - v.double()).abs() <= error_bound(f, x, codes, scale_bytes)).all())
    neg_codes, neg_scales = quantize(-x)
    assert torch.equal(neg_scales, scale_bytes) and torch.equal(dequantize(neg_codes, neg_scales), -v)
    q = dim - f.kw(dim).get("rope_dim", 0)
    assert torch.equal(neg_codes[..., :q], codes[..., :q] ^ f.sign)


@by_name
def test_leading_dims_none_and_zero_size(f):
    dim = SMALL_DIM[f.suffix]
    width = f.layout(dim).bytes_per_entry
    x = torch.randn(dim, generator=torch.Generator().manual_seed(5))
    assert f.fn("encode", dim)(x).shape == (width,)
    assert torch.equal(f.fn("decode", dim)(f.fn("encode", dim)(x)), f.fn("fake_quant", dim)(x))
    for lead in [(0,), (2, 0), (0, 3)]:
        empty = torch.empty(*lead, dim)
        codes, scale_bytes = f.fn("quantize", dim)(empty)
        assert codes.shape == (*lead, dim) and scale_bytes.shape[:-1] == lead
        assert f.fn("encode", dim)(empty).shape == (*lead, width)
        assert f.fn("decode", dim)(torch.empty(*lead, width, dtype=torch.uint8)).shape == (*lead, dim)


@by_name
def test_strided_inputs_and_requires_grad(f):
    dim = SMALL_DIM[f.suffix]
    x = torch.randn(dim, 5, generator=torch.Generator().manual_seed(7)).t()  # [5, dim], column-major
    packed = f.fn("encode", dim)(x.contiguous())
    assert torch.equal(f.fn("encode", dim)(x), packed)
    column_major = packed.t().contiguous().t()
    assert torch.equal(f.fn("decode", dim)(column_major), f.fn("decode", dim)(packed))
    codes, scale_bytes = f.fn("unpack", dim)(column_major)
    assert torch.equal(f.fn("pack", dim)(codes, scale_bytes), packed)
    v = f.fn("fake_quant", dim)(x.clone().requires_grad_())  # quantisers detach their input
    assert not v.requires_grad and torch.equal(v, f.fn("decode", dim)(packed))


@by_name
def test_chunking_does_not_change_results(f, monkeypatch):
    dim = 512 if f.suffix != "index_key" else 128
    x = torch.randn(37, dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    packed, values = f.fn("encode", dim)(x), f.fn("fake_quant", dim)(x)
    monkeypatch.setattr(scales, "CHUNK_VALUES", 3 * dim)
    assert torch.equal(f.fn("encode", dim)(x), packed)
    assert torch.equal(f.fn("decode", dim)(packed), values)
    assert torch.equal(f.fn("fake_quant", dim)(x), values)


@by_name
@pytest.mark.parametrize("case", ["zeros", "tiny", "huge", "fp32_max"])
def test_b15_finite_blocks_give_finite_scales_and_values(f, case):
    dim = SMALL_DIM[f.suffix]
    x = torch.zeros(4, dim)
    x[:, :] = {"zeros": 0.0, "tiny": 1e-30, "huge": 1.0, "fp32_max": 1.0}[case]
    x[:, 0] = {"zeros": 0.0, "tiny": 1e-30, "huge": 1e38, "fp32_max": torch.finfo(torch.float32).max}[case]
    x[1] = -x[1]
    codes, scale_bytes = f.fn("quantize", dim)(x)
    s = scale_values(f, scale_bytes)
    assert bool(s.isfinite().all()) and bool((s > 0).all())
    if f.suffix == "main_kv":
        assert not bool(((scale_bytes & 0x7F) == 0x7F).any())
    v = f.fn("dequantize", dim)(codes, scale_bytes)
    assert bool(v.isfinite().all())
    if case == "zeros":
        assert v.abs().sum().item() == 0.0
    if case in ("huge", "fp32_max"):
        assert v[0, 0].item() > 0 and v[1, 0].item() < 0  # saturated, not zeroed


@by_name
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_b15_non_finite_input_raises(f, bad):
    dim = SMALL_DIM[f.suffix]
    x = torch.ones(3, dim)
    x[2, dim - 1] = bad  # last value: in the RoPE tail for the V4 record
    for op in ("quantize", "encode", "fake_quant"):
        with pytest.raises(ValueError, match=r"non-finite .* row 2"):
            f.fn(op, dim)(x)


@by_name
def test_no_global_scale_parameter(f):  # B15: a global scale of 0 or 1e-50 cannot be passed
    params = inspect.signature(getattr(f.module, f"quantize_{f.suffix}")).parameters
    assert next(iter(params)) == "x" and not any("global" in p for p in params)


@by_name
def test_errors_name_the_bad_value(f):
    dim = SMALL_DIM[f.suffix]
    x = torch.randn(2, dim)
    with pytest.raises(ValueError, match="int64"):
        f.fn("quantize", dim)(torch.ones(2, dim, dtype=torch.int64))
    with pytest.raises(ValueError, match="float64"):
        f.fn("encode", dim)(x.double())
    with pytest.raises(ValueError, match=str(dim + 8)):
        f.fn("quantize", dim)(torch.randn(2, dim + 8))
    packed = f.fn("encode", dim)(x)
    width = packed.shape[-1]
    with pytest.raises(ValueError, match=str(width - 1)):
        f.fn("decode", dim)(packed[..., :-1])
    with pytest.raises(ValueError, match="int16"):
        f.fn("unpack", dim)(packed.to(torch.int16))
    with pytest.raises(ValueError, match="float16"):
        f.fn("decode", dim)(packed, dtype=torch.float16)
    codes, scale_bytes = f.fn("quantize", dim)(x)
    with pytest.raises(ValueError, match="scales"):
        f.fn("pack", dim)(codes, scale_bytes[:1])
    with pytest.raises(ValueError, match="int32"):
        f.fn("dequantize", dim)(codes.to(torch.int32), scale_bytes)
    bad = scale_bytes.clone()
    bad[0, 0] = 0x7F if f.suffix == "main_kv" else 0xFF
    with pytest.raises(ValueError, match="scale byte"):
        f.fn("dequantize", dim)(codes, bad)
    packed[0, -1 - f.layout(dim).pad_bytes] = bad[0, 0]
    with pytest.raises(ValueError, match="scale byte"):
        f.fn("decode", dim)(packed)


def test_stored_scale_bytes_are_checked_with_one_host_read():
    """Every decode checks its rows' stored scale bytes: one read of both ends, not one per end; a byte below or
    above the written range is still named."""
    good = torch.tensor([[0x30, 0x7E], [0x01, 0x38]], dtype=torch.uint8)
    with HostReads() as reads:
        scales.check_scale_bytes(good, (0x01, 0x7E), name="t")
    assert reads.total == 1 and [where.split(":")[0] for _, where in reads.sites] == ["formats/scales.py"]
    for bad, byte in ((good.clone().fill_(0x7F), 127), (torch.zeros(2, 2, dtype=torch.uint8), 0)):
        with pytest.raises(ValueError, match=f"stored scale byte {byte} is outside"):
            scales.check_scale_bytes(bad, (0x01, 0x7E), name="t")


def test_packed_cache_codecs_take_whole_blocks_of_head_dim() -> None:
    from kvdiet.formats.codec import CacheCodecs

    assert CacheCodecs.for_dims(96, 32).window.width == 96 + 96 // 32  # E4M3 bytes + one UE8M0 per 32
    for dim in (80, 72):  # MXFP8 window blocks of 32; 72 is not even whole FP4 blocks of 16
        with pytest.raises(ValueError, match=f"head_dim {dim} is not a multiple of 32") as info:
            CacheCodecs.for_dims(dim, 32)
        assert str(info.value).endswith("use exact caches, kv_cache_dtype='fp32'")  # the keyword from Python
        assert info.value.as_flags().endswith(
            "use exact caches, --kv-cache-dtype fp32"
        )  # the flag on the CLI
        assert CacheCodecs.for_dims(dim, 32, exact=True).window.dim == dim  # fp32 caches take any width
