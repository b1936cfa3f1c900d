"""The compiled RMSNorm and RoPE of decode rows (``formats/rmsnorm_kernels.cpp``, ``formats/rope_kernels.cpp``)
against the torch formulas of `kvdiet.model.layers`: same bits, shapes, strides and dtypes over adversarial
inputs, and the torch formula wherever the kernels do not fit."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvdiet.formats import native
from kvdiet.model import layers
from kvdiet.model.layers import NORM_ROWS_MAX, ROPE_ROWS_MAX, RMSNorm, Rotation

_SPECIALS = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3e-39, 1e-38, 3.4e38, -3.4e38, 1e19, 1e-19)


def _values(
    n: int, gen: torch.Generator, *, specials: bool, nan: bool = True, inf: bool = True
) -> torch.Tensor:
    """fp32 [n] at scales 1e-20..1e19; with ``specials`` every fifth (on average) one of `_SPECIALS` (less NaN
    unless ``nan``, less ±inf unless ``inf``)."""
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-20, 20, (n,), generator=gen).float()
    if specials:
        pool = torch.tensor(
            [v for v in _SPECIALS if (nan or not math.isnan(v)) and (inf or not math.isinf(v))]
        )
        chosen = torch.rand(n, generator=gen) < 0.2
        x[chosen] = pool[torch.randint(len(pool), (int(chosen.sum()),), generator=gen)]
    return x


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same shape, strides, dtype and bits (NaN payloads included)."""
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert torch.equal(got.view(_BITS[got.dtype]), want.view(_BITS[want.dtype]))


def _kernels():
    kernels = native.fp4_kernels()
    assert kernels is not None, "the compiled kernels did not build"
    return kernels


def _rotation(d: int, t: int, gen: torch.Generator, *, specials: bool = False) -> Rotation:
    angles = torch.rand(t, d // 2, generator=gen) * 1e4
    cis = torch.polar(torch.ones(t, d // 2), angles)
    if specials:  # ±0, inf, NaN in the factors too
        cis = torch.view_as_complex(_values(t * d, gen, specials=True).view(t, d // 2, 2))
    return Rotation(d, cis, cis.conj().resolve_conj())


def _skew_torch_rotation(monkeypatch) -> None:
    """The torch formula one ulp off (so no compiled rotation agrees with it), the checks' cache cleared."""
    torch_formula = layers._torch_rotate
    monkeypatch.setattr(
        layers, "_torch_rotate", lambda *a: torch_formula(*a).add_(0.0).nextafter_(torch.tensor(1e30))
    )
    layers.kernels_agree.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_rms_norm_kernel_equals_torch_formula_at_every_width(rows, eps):
    # every width 1..1024: every split of a vector loop and its tail, in the squares, torch's sum and the products
    # x: ±0, subnormals, 3.4e38 (its square overflows: the scale is 0); weight: ±inf too (inf · 0 is NaN)
    gen = torch.Generator().manual_seed(rows)
    kernels = _kernels()
    compared = 0
    for width in range(1, 1025):
        x = _values(rows * width, gen, specials=width % 2 == 0, nan=False, inf=False).view(rows, width)
        weight = _values(width, gen, specials=width % 3 == 0, nan=False)
        want = layers._torch_rms_norm(x, weight, eps)
        got = kernels.rms_norm(x, weight, eps)
        if want.isnan().any():  # the kernel declines NaN outputs: the torch formula decides
            assert got is None
        else:
            _assert_same(got, want)
            compared += 1
    assert compared > 500  # most widths ran in the kernel


@pytest.mark.parametrize("width", [1, 7, 16, 17, 128, 255, 256, 512, 1000])
def test_rms_norm_forward_equals_torch_path_for_1_to_16_rows(both, width):
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, 1e-20)
    with torch.no_grad():
        norm.weight.copy_(_values(width, gen, specials=False))
        for rows in range(1, NORM_ROWS_MAX + 1):
            x = _values(rows * width, gen, specials=True).view(1, rows, width)  # NaN rows too
            compiled, pure = both(norm, x)
            _assert_same(compiled, pure)
            _assert_same(compiled, layers._torch_rms_norm(x, norm.weight, norm.eps))


def test_rms_norm_zero_row_and_tiny_rows_with_eps_1e_20():
    # all-zero rows give zeros only because 0 · rsqrt(1e-20) = 0; subnormal rows sum to 0 or to subnormals
    kernels = _kernels()
    weight = torch.tensor([1.0, -2.0, 0.5, -3.0])
    x = torch.tensor([[0.0, -0.0, 0.0, 0.0], [1e-45, -1e-45, 0.0, 1e-40], [1e-20, 1e-21, -1e-19, 0.0]])
    got = kernels.rms_norm(x, weight, 1e-20)
    _assert_same(got, layers._torch_rms_norm(x, weight, 1e-20))
    assert torch.equal(got[0].view(torch.int32), torch.tensor([0.0, 0.0, 0.0, -0.0]).view(torch.int32))


def test_rms_norm_falls_back_to_torch_where_the_kernel_does_not_fit(monkeypatch):
    kernels = _kernels()
    norm = RMSNorm(64, 1e-6)
    weight = norm.weight.detach()
    x = torch.randn(NORM_ROWS_MAX + 1, 64)
    assert kernels.rms_norm(x, weight, 1e-6) is None  # too many rows: a prefill's
    assert kernels.rms_norm(x[:NORM_ROWS_MAX], weight, 1e-6) is not None
    assert kernels.rms_norm(torch.randn(64, 4).t(), weight, 1e-6) is None  # not contiguous
    assert (
        kernels.rms_norm(torch.randn(2, layers.WIDTH_MAX + 1), torch.ones(layers.WIDTH_MAX + 1), 1e-6) is None
    )
    assert kernels.rms_norm(torch.tensor([[math.nan] + [1.0] * 63]), weight, 1e-6) is None  # a NaN output
    assert layers.kernels_agree("rms_norm")  # checked (with the torch formula) before the spy goes in
    calls = []
    torch_formula = layers._torch_rms_norm
    monkeypatch.setattr(layers, "_torch_rms_norm", lambda *a: calls.append(a[0].dtype) or torch_formula(*a))
    with torch.no_grad():
        norm(torch.randn(3, 64))
        assert calls == []  # the kernel ran
        for x in (torch.randn(3, 64, dtype=torch.float64), torch.randn(3, 64, dtype=torch.bfloat16)):
            out = norm(x)
            assert out.dtype == layers.widen(x).dtype
            _assert_same(out, torch_formula(x, weight, 1e-6))
        norm(torch.randn(64, 3).t())  # not contiguous
        assert RMSNorm(64, 1e-6).to("meta")(torch.randn(3, 64, device="meta")).is_meta  # not on the CPU
    assert calls == [torch.float64, torch.bfloat16, torch.float32, torch.float32]
    out = norm(torch.randn(3, 64))  # grad enabled, weight requires grad: autograd needs the torch ops
    assert out.grad_fn is not None and len(calls) == 5
    monkeypatch.setenv(native.ENV, "0")
    with torch.no_grad():
        norm(torch.randn(3, 64))
    assert len(calls) == 6


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_kernel_takes_a_prefills_rows_with_the_formulas_bits(threads):
    """``any_rows``: any number of rows (a prefill's, as `RMSNorm` asks) = the torch formula to the bit, over
    widths either side of the vector loops (and one row-count split past GRAIN_SIZE elements), adversarial
    values, on one and two threads (torch's sum splits over rows); NaN outputs still declined. Without it, more
    than `NORM_ROWS_MAX` rows are declined; `RMSNorm` runs such rows in the kernel."""
    gen = torch.Generator().manual_seed(threads)
    kernels = _kernels()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compared = 0
        for rows, width in (
            (17, 1),
            (61, 17),
            (256, 64),
            (257, 79),
            (300, 128),
            (1000, 33),
            (2048, 64),
            (40, 1025),
        ):
            x = _values(rows * width, gen, specials=rows % 2 == 0, nan=False, inf=False).view(rows, width)
            weight = _values(width, gen, specials=width % 3 == 0, nan=False)
            for eps in (1e-20, 1e-6):
                want = layers._torch_rms_norm(x, weight, eps)
                got = kernels.rms_norm(x, weight, eps, any_rows=True)
                assert kernels.rms_norm(x, weight, eps) is None
                if want.isnan().any():
                    assert got is None
                else:
                    _assert_same(got, want)
                    compared += 1
        assert compared >= 10
    finally:
        torch.set_num_threads(old)
    norm = RMSNorm(64, 1e-20)
    x = torch.randn(300, 64)
    with torch.no_grad():
        norm.weight.copy_(_values(64, gen, specials=False))
        want = layers._torch_rms_norm(x, norm.weight, norm.eps)
        assert layers.kernels_agree("rms_norm")
        calls = []
        torch_formula = layers._torch_rms_norm
        layers._torch_rms_norm = lambda *a: calls.append(a) or torch_formula(*a)
        try:
            _assert_same(norm(x), want)
        finally:
            layers._torch_rms_norm = torch_formula
        assert calls == []  # the kernel ran


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotation_kernel_equals_torch_formula(d, inverse):
    gen = torch.Generator().manual_seed(d)
    kernels = _kernels()
    compared = []
    for t in range(1, 17):
        for heads, width in ((1, d), (4, d + 2), (4, 512), (3, d + 64)):
            rot = _rotation(d, t, gen, specials=t % 2 == 0)
            cis = rot.cis_inverse if inverse else rot.cis
            x = _values(t * heads * width, gen, specials=t % 3 == 0).view(t, heads, width)
            views = (
                x.transpose(0, 1),  # q [H, T, D] as attention rotates it: strided rows
                x.transpose(0, 1).contiguous(),
                x[:, 0],  # [T, D] rows with gaps: the clone's strides are dense
                x[:, :1].expand(t, 5, width).transpose(0, 1),  # rows repeated (stride 0)
            )
            for v in views:
                got = kernels.rope_rotate(v, cis, d)
                want = layers._torch_rotate(v, cis, d)
                _assert_same(rot.apply(v, inverse=inverse), want)
                if want.isnan().any():  # a NaN output: the kernel declines, the torch formula decides
                    assert got is None
                else:
                    _assert_same(got, want)
                    compared.append(v.shape)
    assert len(compared) > 16  # most inputs ran in the kernel


@pytest.mark.parametrize("d", [2, 8, 16, 24, 48])
def test_rotation_off_multiples_of_32_runs_the_kernel_only_where_torchs_tail_agrees(d, monkeypatch):
    # rope_dim d not a multiple of 32: torch's complex product runs its scalar tail, whose bits on this build
    # decide whether the kernel may run; either way the rotation has the torch formula's bits
    gen = torch.Generator().manual_seed(d)
    agree = layers.kernels_agree("rope_rotate", d)
    calls = []
    kernels = _kernels()
    spy = type("Spy", (), {"rope_rotate": lambda self, *a: calls.append(1) or kernels.rope_rotate(*a)})()
    monkeypatch.setattr(layers, "_checked_kernels", lambda op: spy if op == "rope_rotate" else None)
    compared = 0
    for t in range(1, 17):
        rot = _rotation(d, t, gen, specials=t % 2 == 0)
        x = _values(t * 4 * (d + 64), gen, specials=t % 3 == 0).view(t, 4, d + 64)
        for v in (x.transpose(0, 1), x[:, 0]):
            for inverse in (False, True):
                want = layers._torch_rotate(v, rot.cis_inverse if inverse else rot.cis, d)
                _assert_same(rot.apply(v, inverse=inverse), want)
                compared += 1
    assert len(calls) == (compared if agree else 0)


def test_rotation_tail_check_at_a_rope_dim(monkeypatch, caplog):
    kernels = _kernels()
    # the kernel rounds as c10::complex's operator*= without FMA: where torch's tail computes that, they agree
    x, c = torch.randn(5, 4, 80), torch.polar(torch.ones(5, 8), torch.rand(5, 8) * 100)
    plain = kernels.rope_rotate(x, c[:, None], 16)
    pairs = x[..., 64:].reshape(5, 4, 8, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    re, im = torch.view_as_real(c)[:, None, :, 0], torch.view_as_real(c)[:, None, :, 1]
    _assert_same(
        plain[..., 64:].contiguous(), torch.stack([a * re - b * im, a * im + b * re], -1).flatten(-2)
    )
    _assert_same(plain[..., :64].contiguous(), x[..., :64].contiguous())
    _skew_torch_rotation(monkeypatch)
    try:
        with caplog.at_level(logging.INFO, logger="kvdiet.model.layers"):
            assert not layers.kernels_agree("rope_rotate", 16)
        assert "rope_dim 16: torch's scalar tail rounds otherwise" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # expected, not a fault
        assert layers.rope_kernels(16) is None
    finally:
        layers.kernels_agree.cache_clear()
    for op, rope_dim in (("rms_norm", 16), ("rope_rotate", 64), ("rope_rotate", 15), ("rope_rotate", 0)):
        with pytest.raises(ValueError, match="is not checked at rope_dim"):
            layers.kernels_agree(op, rope_dim)


@pytest.mark.parametrize("d", [272, 1024])
def test_rotation_of_grain_size_pairs_or_more_keeps_the_torch_formula(d):
    # torch splits a product of 32768 pairs or more over its threads (3 here) at chunk boundaries off a whole
    # vector (34680 pairs over 3 threads: 11560 each): its scalar tail lands mid-row, where the kernel does not
    # run its own; the rotation must keep torch's bits, so the kernel declines
    kernels = _kernels()
    gen = torch.Generator().manual_seed(d)
    rows = 255 if d == 272 else 131
    rot = _rotation(d, rows, gen)
    x = torch.randn(rows, d, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _assert_same(rot.apply(x), layers._torch_rotate(x, rot.cis, d))
        assert kernels.rope_rotate(x, rot.cis, d) is None
        under = 32768 // (d // 2) - 1  # rows of fewer pairs than that: the kernel runs them
        assert kernels.rope_rotate(x[:under], rot.cis[:under], d) is not None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d", [16, 64, 272])
def test_rotation_of_a_prefills_rows_runs_the_kernel_on_one_thread_only(d, monkeypatch):
    # a prefill's queries [H, T, D] (transposed views, T odd and even) and window rows [T, D]: more than
    # ROPE_ROWS_MAX rows and 32768 pairs; on one torch thread (its loop unsplit) the kernel runs them with the
    # torch formula's bits; on three, where torch's own bits vary with its split, the torch formula runs
    gen = torch.Generator().manual_seed(d)
    kernels = _kernels()
    calls = []  # the kernel's results Rotation.apply used (not declined)

    def rotate(self, *args):
        out = kernels.rope_rotate(*args)
        calls.extend([] if out is None else [1])
        return out

    spy = type("Spy", (), {"rope_rotate": rotate})()
    assert layers.kernels_agree("rope_rotate") and (d % 32 == 0 or layers.kernels_agree("rope_rotate", d))
    monkeypatch.setattr(layers, "_checked_kernels", lambda op: spy if op == "rope_rotate" else None)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            for t in (1023, 1025, 2048):  # specials in cis, none, in x (NaN outputs: the torch formula runs)
                rot = _rotation(d, t, gen, specials=t == 1023)
                x = _values(t * 4 * (d + 48), gen, specials=t == 2048).view(t, 4, d + 48)
                for v in (x.transpose(0, 1), x[:, 1]):
                    assert v.numel() // v.shape[-1] > ROPE_ROWS_MAX
                    for inverse in (False, True):
                        cis = rot.cis_inverse if inverse else rot.cis
                        if n_threads == 1:
                            got = kernels.rope_rotate(v, cis, d, True)
                            assert got is not None or torch.isnan(layers._torch_rotate(v, cis, d)).any()
                            assert kernels.rope_rotate(v, cis, d) is None  # no any_rows: the caps hold
                        _assert_same(rot.apply(v, inverse=inverse), layers._torch_rotate(v, cis, d))
            assert (len(calls) > 0) == (n_threads == 1)
            calls.clear()
    finally:
        torch.set_num_threads(threads)


def test_rotation_broadcasts_cis_over_heads(both):
    gen = torch.Generator().manual_seed(1)
    rot = _rotation(64, 5, gen)
    x = _values(5 * 4 * 512, gen, specials=True).view(5, 4, 512)
    cis = rot.cis.unsqueeze(1)  # [T, 1, d/2] against x [T, H, D]
    wide = Rotation(64, cis, cis.conj().resolve_conj())
    for inverse in (False, True):
        compiled, pure = both(wide.apply, x, inverse=inverse)
        _assert_same(compiled, pure)
        _assert_same(compiled, rot.apply(x.transpose(0, 1), inverse=inverse).transpose(0, 1))


def test_rotation_falls_back_to_torch_where_the_kernel_does_not_fit(monkeypatch):
    kernels = _kernels()
    gen = torch.Generator().manual_seed(2)
    rot = _rotation(64, 4, gen)
    assert kernels.rope_rotate(torch.randn(4, 64), rot.cis, 64) is not None
    assert (
        kernels.rope_rotate(torch.randn(4, 48), _rotation(16, 4, gen).cis[:, :7], 15) is None
    )  # odd rope_dim
    assert kernels.rope_rotate(torch.randn(128, 4).t(), rot.cis, 64) is None  # last stride 2
    assert kernels.rope_rotate(torch.randn(ROPE_ROWS_MAX + 1, 64), rot.cis[:1], 64) is None
    assert kernels.rope_rotate(torch.randn(3, 64), rot.cis, 64) is None  # cis would broadcast x (4 vs 3)
    assert kernels.rope_rotate(torch.randn(4, 64), rot.cis.to(torch.complex128), 64) is None
    assert layers.kernels_agree("rope_rotate")  # checked (with the torch formula) before the spy goes in
    calls = []
    torch_formula = layers._torch_rotate
    monkeypatch.setattr(layers, "_torch_rotate", lambda *a: calls.append(a[0].dtype) or torch_formula(*a))
    rot.apply(torch.randn(4, 64))
    assert calls == []  # the kernel ran
    for x in (torch.randn(4, 64, dtype=torch.float64), torch.randn(4, 64, dtype=torch.bfloat16)):
        out = rot.apply(x)
        assert out.dtype == x.dtype
        _assert_same(out, torch_formula(x, rot.cis, 64))

    x = torch.randn(4, 64, requires_grad=True)
    assert rot.apply(x).grad_fn is not None  # autograd needs the torch ops
    assert calls == [torch.float64, torch.bfloat16, torch.float32]
    monkeypatch.setenv(native.ENV, "0")
    rot.apply(torch.randn(4, 64))
    assert len(calls) == 4
    with pytest.raises(ValueError, match="smaller than rope_dim"):
        rot.apply(torch.randn(4, 32))


def test_a_mismatch_keeps_the_torch_formula(monkeypatch, caplog):
    assert layers.kernels_agree("rms_norm") and layers.kernels_agree("rope_rotate")
    _skew_torch_rotation(monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger="kvdiet.model.layers"):
            assert not layers.kernels_agree("rope_rotate")
            assert layers._checked_kernels("rope_rotate") is None
        assert "compiled rope_rotate differs" in caplog.text
        assert layers.kernels_agree("rms_norm")
    finally:
        layers.kernels_agree.cache_clear()
    with pytest.raises(ValueError, match="unknown kernel"):
        layers.kernels_agree("softmax")


def test_the_check_builds_fp32_cpu_inputs_whatever_torchs_default_dtype():
    # with float64 as the default dtype the check's inputs would all be declined and the kernels never used
    previous = torch.get_default_dtype()
    layers.kernels_agree.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        assert layers.kernels_agree("rms_norm") and layers.kernels_agree("rope_rotate")
    finally:
        torch.set_default_dtype(previous)
        layers.kernels_agree.cache_clear()


def test_lazy_conjugate_and_negative_views_get_their_values_not_their_data():
    """A ``cis.conj()`` (or a negative view) shares the data of ``cis`` and flips it only when read through
    torch: the kernels must decline it, not read the unflipped data."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(3)
    rot = _rotation(64, 4, gen)
    x = _values(4 * 64, gen, specials=False).view(4, 64)
    lazy = rot.cis.conj()
    assert lazy.is_conj()
    assert kernels.rope_rotate(x, lazy, 64) is None
    assert kernels.rope_rotate(x, torch._neg_view(rot.cis), 64) is None
    assert kernels.rope_rotate(torch._neg_view(x), rot.cis, 64) is None
    assert kernels.rms_norm(torch._neg_view(x), torch.ones(64), 1e-6) is None
    assert kernels.rms_norm(x, torch._neg_view(torch.ones(64)), 1e-6) is None
    with torch.no_grad():
        _assert_same(Rotation(64, lazy, rot.cis).apply(x), rot.apply(x, inverse=True))
        norm = RMSNorm(64, 1e-6)
        _assert_same(norm(torch._neg_view(x)), norm(-x))
