"""The compiled mHC entry and exit of decode rows (``formats/hc_kernels.cpp``: ``hc_enter``, ``hc_expand_rows``)
against the torch functions of `kvdiet.model.hc`: same bits over adversarial inputs, and those functions wherever
the kernels do not fit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvdiet.formats import native
from kvdiet.model import hc as hc_module
from kvdiet.model import layers
from kvdiet.model.chain_products import ChainForm, chain_agrees, chain_fits, product_fits
from kvdiet.model.hc import add_sublayer_hc, hc_coefficients, hc_collapse, hc_expand, sublayer_entry
from kvdiet.model.layers import RMSNorm
from kvdiet.model.sinkhorn import hc_mix_address

RMS_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20
_SPECIALS = (0.0, -0.0, math.inf, -math.inf, 1e-45, -3e-39, 1e-38, 3.4e38, -3.4e38, 1e19, 1e-19)


def _values(n: int, gen: torch.Generator, *, specials: bool, nan: bool = False) -> torch.Tensor:
    """fp32 [n]: normal draws, or at scales 1e-20..1e19 with every fifth one of `_SPECIALS` (and NaN if asked)."""
    if not specials:
        return torch.randn(n, generator=gen)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-20, 20, (n,), generator=gen).float()
    pool = torch.tensor([*_SPECIALS, *((math.nan,) if nan else ())])
    chosen = torch.rand(n, generator=gen) < 0.2
    x[chosen] = pool[torch.randint(len(pool), (int(chosen.sum()),), generator=gen)]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """Same shapes, dtypes and bits (NaN payloads included)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        assert torch.equal(_bits(g), _bits(w))


def _block(hc: int, hidden: int, gen: torch.Generator, *, specials: bool):
    """A module with one sublayer's mHC parameters and its norm, as the model's blocks hold them, and its config."""
    cfg = SimpleNamespace(
        hc_mult=hc, hidden_size=hidden, rms_norm_eps=RMS_EPS, hc_eps=HC_EPS, hc_sinkhorn_iters=ITERS
    )
    block = nn.Module()
    add_sublayer_hc(block, cfg)
    norm = RMSNorm(hidden, RMS_EPS)
    with torch.no_grad():
        block.hc_attn_fn.copy_(
            _values(block.hc_attn_fn.numel(), gen, specials=specials).view_as(block.hc_attn_fn)
        )
        block.hc_attn_scale.copy_(torch.rand(3, generator=gen) * 2)
        block.hc_attn_base.copy_(_values(block.hc_attn_base.numel(), gen, specials=specials))
        norm.weight.copy_(_values(hidden, gen, specials=specials))
    return block, cfg, norm


def _formulas(block, cfg, norm, h, collapse_pre):
    """The entry as the functions compute it one by one: the norm's torch formula of the collapse, and
    `hc_coefficients` (test_model_sinkhorn.py holds its compiled mix to the torch ops)."""
    with torch.no_grad():
        coefficients = hc_coefficients(
            h,
            block.hc_attn_fn.detach(),
            block.hc_attn_scale.detach(),
            block.hc_attn_base.detach(),
            hc_mult=cfg.hc_mult,
            rms_eps=RMS_EPS,
            hc_eps=HC_EPS,
            sinkhorn_iters=ITERS,
        )
    return (
        layers._torch_rms_norm(hc_collapse(h, collapse_pre), norm.weight.detach(), norm.eps),
        *coefficients,
    )


def _kernels():
    kernels = native.fp4_kernels()
    assert kernels is not None, "the compiled kernels did not build"
    assert hc_mix_address() is not None, "the Sinkhorn kernel or torch's vector exp was not found"
    return kernels


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("hidden", [1, 15, 16, 17, 256, 1024])
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_entry_equals_the_collapse_norm_and_coefficients_bit_for_bit(hc, rows, hidden, specials, threads):
    # at two threads a chained entry runs its coefficients beside the collapse, its norm and the squares' mean where
    # the squares hold fewer than GRAIN_SIZE elements (hidden 1024 at 16 rows and hc 4 does not: in turn); at one,
    # always in turn
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _entry_case(hc, rows, hidden, specials)
    finally:
        torch.set_num_threads(before)


def _entry_case(hc: int, rows: int, hidden: int, specials: bool) -> None:
    kernels = _kernels()
    gen = torch.Generator().manual_seed(1000 * hc + 10 * rows + hidden)
    block, cfg, norm = _block(hc, hidden, gen, specials=specials)
    h = _values(rows * hc * hidden, gen, specials=specials).view(rows, hc, hidden)
    collapse_pre = _values(rows * hc, gen, specials=specials).view(rows, hc)
    want = _formulas(block, cfg, norm, h, collapse_pre)
    with torch.no_grad():
        got = sublayer_entry(block, cfg, h, "attn", collapse_pre, norm)
        weights = block.hc_weights["attn"]
        direct = kernels.hc_enter(
            h, weights.fn_t, weights.scale, weights.base, collapse_pre, norm.weight, norm.eps,
            RMS_EPS, HC_EPS, ITERS, hc_mix_address(),
        )  # fmt: skip
    _assert_same(got, want)
    if not specials:  # no NaN in x: the kernel itself gave these bits
        assert direct is not None
        _assert_same(direct, want)
    elif direct is not None:
        _assert_same(direct, want)
    # the coefficients' product as chain_mm where it was checked against torch.mm at this class (NaN outputs: mm's)
    cols = weights.fn_t.stride(0) == 1 and weights.fn_t.stride(1) != 1
    block = product_fits(rows, hc * hidden, weights.fn_t.shape[1], False, cols)
    if block:
        with torch.no_grad():
            chained = kernels.hc_enter(
                h, weights.fn_t, weights.scale, weights.base, collapse_pre, norm.weight, norm.eps,
                RMS_EPS, HC_EPS, ITERS, hc_mix_address(), mix_block=block,
            )  # fmt: skip
        assert (chained is None) == (direct is None)
        if chained is not None:
            _assert_same(chained, want)


@pytest.mark.parametrize("hc", [1, 4])
def test_entry_collapse_of_signed_zero_products_keeps_torchs_sign(hc):
    """The collapse Σ_i pre_i·h_i sums from +0 as torch does: columns whose products are all −0 (h = −0 under a
    positive pre, or pre = −0 under a positive h) collapse to +0, not −0 (the norm keeps the sign, so a wrong
    start shows in x's bits); no NaN or inf, so the kernel itself must answer."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(7 + hc)
    rows, hidden = 3, 17
    block, cfg, norm = _block(hc, hidden, gen, specials=False)
    h = torch.rand(rows, hc, hidden, generator=gen) + 0.5
    h[0, :, :5] = -0.0  # row 0: five columns of −0 under positive pre
    collapse_pre = torch.rand(rows, hc, generator=gen) + 0.25
    collapse_pre[1] = -0.0  # row 1: every product −0
    collapse_pre[2, 0] = -0.0  # row 2: one −0 product among positives
    want = _formulas(block, cfg, norm, h, collapse_pre)
    collapsed = hc_collapse(h, collapse_pre)
    assert torch.equal(_bits(collapsed[0, :5]), _bits(torch.zeros(5)))  # torch's collapse gives +0 there
    assert torch.equal(_bits(collapsed[1]), _bits(torch.zeros(hidden)))
    with torch.no_grad():
        sublayer_entry(block, cfg, h, "attn", collapse_pre, norm)  # builds the cached weights
        weights = block.hc_weights["attn"]
        direct = kernels.hc_enter(
            h, weights.fn_t, weights.scale, weights.base, collapse_pre, norm.weight, norm.eps,
            RMS_EPS, HC_EPS, ITERS, hc_mix_address(),
        )  # fmt: skip
    assert direct is not None
    _assert_same(direct, want)


def test_entry_runs_the_kernel_in_a_decode_step_and_the_functions_elsewhere(monkeypatch):
    _kernels()
    gen = torch.Generator().manual_seed(5)
    block, cfg, norm = _block(4, 32, gen, specials=False)
    calls = []
    monkeypatch.setattr(hc_module, "hc_collapse", lambda *a: calls.append("collapse") or hc_collapse(*a))

    def entry(h, collapse_pre):
        got = sublayer_entry(block, cfg, h, "attn", collapse_pre, norm)
        _assert_same(got, _formulas(block, cfg, norm, h, collapse_pre))

    with torch.no_grad():
        entry(torch.randn(16, 4, 32, generator=gen), torch.rand(16, 4, generator=gen))
        assert calls == []  # one compiled call
        entry(torch.randn(17, 4, 32, generator=gen), torch.rand(17, 4, generator=gen))  # a prefill's rows
        assert calls == []
        entry(
            torch.randn(257, 4, 32, generator=gen), torch.rand(257, 4, generator=gen)
        )  # past the mix kernel's
        assert calls == ["collapse"]
        monkeypatch.setenv(native.ENV, "0")
        entry(torch.randn(3, 4, 32, generator=gen), torch.rand(3, 4, generator=gen))
        assert calls == ["collapse"] * 2
        monkeypatch.delenv(native.ENV)
        entry(
            torch.randn(3, 4, 32, generator=gen).transpose(0, 1).contiguous().transpose(0, 1),
            torch.rand(3, 4),
        )
        assert calls == ["collapse"] * 3  # not contiguous: declined
    h = torch.randn(2, 4, 32, generator=gen)
    entry(h, torch.rand(2, 4, generator=gen))  # autograd on
    assert calls == ["collapse"] * 4
    with torch.no_grad():  # streams of a model run in fp64
        got = sublayer_entry(
            block.double(), cfg, h.double(), "attn", torch.rand(2, 4).double(), norm.double()
        )
    assert got[0].dtype == got[1].dtype == torch.float64 and calls == ["collapse"] * 5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "hc", "hidden"), [(17, 4, 64), (61, 2, 17), (256, 4, 64), (256, 4, 256)])
def test_entry_takes_a_prefills_rows_with_the_functions_bits(rows, hc, hidden, threads):
    """``any_rows``: a prefill chunk's rows (up to the mix kernel's 256, as `sublayer_entry` asks) = the functions
    to the bit on adversarial values, on one and two threads; without ``any_rows`` they are declined."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(rows + hidden + threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for specials in (False, True):
            block, cfg, norm = _block(hc, hidden, gen, specials=specials)
            h = _values(rows * hc * hidden, gen, specials=specials).view(rows, hc, hidden)
            collapse_pre = _values(rows * hc, gen, specials=specials).view(rows, hc)
            want = _formulas(block, cfg, norm, h, collapse_pre)
            with torch.no_grad():
                _assert_same(sublayer_entry(block, cfg, h, "attn", collapse_pre, norm), want)
                w = block.hc_weights["attn"]
                args = (
                    h,
                    w.fn_t,
                    w.scale,
                    w.base,
                    collapse_pre,
                    norm.weight,
                    norm.eps,
                    RMS_EPS,
                    HC_EPS,
                    ITERS,
                )
                assert kernels.hc_enter(*args, hc_mix_address()) is None
                direct = kernels.hc_enter(*args, hc_mix_address(), any_rows=True)
            assert direct is not None or specials
            if direct is not None:
                _assert_same(direct, want)
    finally:
        torch.set_num_threads(old)


def test_entry_kernel_declines_what_it_does_not_fit():
    kernels = _kernels()
    gen = torch.Generator().manual_seed(6)
    block, cfg, norm = _block(4, 16, gen, specials=False)
    with torch.no_grad():
        sublayer_entry(block, cfg, torch.randn(1, 4, 16), "attn", torch.rand(1, 4), norm)
    w = block.hc_weights["attn"]
    mix = hc_mix_address()
    h, pre = torch.randn(2, 4, 16, generator=gen), torch.rand(2, 4, generator=gen)

    def enter(
        h=h, fn_t=w.fn_t, scale=w.scale, base=w.base, pre=pre, weight=norm.weight, iters=ITERS, mix=mix
    ):
        return kernels.hc_enter(h, fn_t, scale, base, pre, weight, RMS_EPS, RMS_EPS, HC_EPS, iters, mix)

    with torch.no_grad():
        assert enter() is not None
        assert enter(h=torch.randn(17, 4, 16), pre=torch.rand(17, 4)) is None  # more than 16 rows
        assert enter(h=torch.randn(2, 4, 16).double()) is None
        assert enter(h=torch.randn(2, 16, 4).transpose(1, 2)) is None  # not contiguous
        assert enter(h=torch._neg_view(h)) is None  # a lazy negation: its data is not its value
        assert enter(weight=torch._neg_view(norm.weight)) is None
        assert enter(pre=torch.rand(2, 3)) is None
        assert enter(fn_t=w.fn_t[:-1]) is None
        assert enter(scale=w.scale[:-1]) is None
        assert enter(iters=0) is None
        assert enter(mix=(0, mix[1], mix[2])) is None
        assert enter(h=torch.full((2, 4, 16), math.nan)) is None  # a NaN in x: the torch functions run it
        # hc 5: torch sums 5 values in another order than one at a time
        five, cfg5, norm5 = _block(5, 16, gen, specials=False)
        sublayer_entry(five, cfg5, torch.randn(1, 5, 16), "attn", torch.rand(1, 5), norm5)
        w5 = five.hc_weights["attn"]
        assert kernels.hc_enter(
            torch.randn(1, 5, 16), w5.fn_t, w5.scale, w5.base, torch.rand(1, 5), norm5.weight,
            RMS_EPS, RMS_EPS, HC_EPS, ITERS, mix,
        ) is None  # fmt: skip


def _expand_formula(x, residual, post, comb):
    return post[..., None] * x[..., None, :] + torch.bmm(comb.transpose(-1, -2), residual)


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("hidden", [1, 17, 256])
@pytest.mark.parametrize("specials", [False, True])
def test_expand_rows_equal_the_torch_formula_bit_for_bit(hc, rows, hidden, specials):
    kernels = _kernels()
    gen = torch.Generator().manual_seed(100 * hc + 10 * rows + hidden)
    x = _values(rows * hidden, gen, specials=specials, nan=True).view(rows, hidden)
    residual = _values(rows * hc * hidden, gen, specials=specials, nan=True).view(rows, hc, hidden)
    post = _values(rows * hc, gen, specials=specials).view(rows, hc)
    comb = _values(rows * hc * hc, gen, specials=specials).view(rows, hc, hc)
    want = _expand_formula(x, residual, post, comb)
    with torch.no_grad():
        _assert_same((hc_expand(x, residual, post, comb),), (want,))
        # any layout: transposed copies read as their values
        views = (
            x.T.contiguous().T,
            residual.transpose(0, 2).contiguous().transpose(0, 2),
            post.T.contiguous().T,
            comb.transpose(1, 2).contiguous().transpose(1, 2),
        )
        _assert_same((hc_expand(*views),), (want,))
        direct = kernels.hc_expand_rows(x, residual, post, comb)
    if not specials:
        assert direct is not None
    if direct is not None:
        assert not want.isnan().any()  # it declines a NaN output
        _assert_same((direct,), (want,))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "hc", "hidden"), [(17, 4, 64), (300, 4, 17), (2048, 4, 64), (61, 2, 256)])
def test_expand_rows_take_a_prefills_rows_with_the_formulas_bits(rows, hc, hidden, threads):
    """``any_rows``: more rows than a decode step's (a prefill's, as `hc_expand` asks) = the torch formula to the
    bit on adversarial values (±0, subnormals, huge, ±inf), on one and two threads; NaN outputs still declined;
    without ``any_rows`` they are declined."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(rows + hidden)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for specials in (False, True):
            x = _values(rows * hidden, gen, specials=specials, nan=False).view(rows, hidden)
            residual = _values(rows * hc * hidden, gen, specials=specials, nan=False).view(rows, hc, hidden)
            post = _values(rows * hc, gen, specials=specials, nan=False).view(rows, hc)
            comb = _values(rows * hc * hc, gen, specials=specials, nan=False).view(rows, hc, hc)
            want = _expand_formula(x, residual, post, comb)
            assert kernels.hc_expand_rows(x, residual, post, comb) is None
            got = kernels.hc_expand_rows(x, residual, post, comb, any_rows=True)
            # the compiled product, where it has matched torch.bmm at this shape
            chained = chain_fits(hc, hc, hidden, True, False)
            # below 400, torch sums rounded products in a loop of its own; above, in the form of the chain this
            # machine's BLAS sums as (MKL's Zen code path: the chain, then +0), if any
            assert chained is (
                chain_agrees(
                    hc, hc, hidden, True, False, torch.get_float32_matmul_precision(), threads, single=False
                )
                if hc * hc * hidden >= 400
                else ChainForm.NONE
            )
            chain = kernels.hc_expand_rows(
                x, residual, post, comb, any_rows=True, chain=bool(chained), **chained.kernel_flags
            )
            if want.isnan().any():
                assert got is None and chain is None and specials
            else:
                _assert_same((got,), (want,))
                _assert_same((chain,), (want,))
            with torch.no_grad():
                _assert_same((hc_expand(x, residual, post, comb),), (want,))
    finally:
        torch.set_num_threads(old)


def test_expand_rows_pass_the_chains_form_on():
    """``settle_zero`` reaches the chain: mixed streams whose products all round to −0 read +0 in the settled form, so
    with ``post · x = −0`` the output is +0 there and −0 from the plain chain; `hc_expand` gives torch.bmm's sign."""
    kernels = _kernels()
    rows, hc, hidden = 32, 4, 64
    x = torch.ones(rows, hidden)
    post = torch.full((rows, hc), -0.0)
    comb = torch.full((rows, hc, hc), 2.0**-80)
    residual = torch.full((rows, hc, hidden), -(2.0**-80))
    plain = kernels.hc_expand_rows(x, residual, post, comb, any_rows=True, chain=True)
    settled = kernels.hc_expand_rows(x, residual, post, comb, any_rows=True, chain=True, settle_zero=True)
    assert torch.equal(plain.view(torch.int32), torch.full((rows, hc, hidden), -(2**31), dtype=torch.int32))
    assert torch.equal(settled.view(torch.int32), torch.zeros(rows, hc, hidden, dtype=torch.int32))
    want = _expand_formula(x, residual, post, comb)
    with torch.no_grad():
        _assert_same((hc_expand(x, residual, post, comb),), (want,))


def test_expand_rows_decline_what_they_do_not_fit():
    kernels = _kernels()
    x, residual, post, comb = torch.randn(2, 8), torch.randn(2, 4, 8), torch.rand(2, 4), torch.rand(2, 4, 4)
    assert kernels.hc_expand_rows(x, residual, post, comb) is not None
    assert (
        kernels.hc_expand_rows(
            torch.randn(17, 8), torch.randn(17, 4, 8), torch.rand(17, 4), torch.rand(17, 4, 4)
        )
        is None
    )
    assert kernels.hc_expand_rows(x.double(), residual, post, comb) is None
    assert kernels.hc_expand_rows(x[:1], residual, post, comb) is None  # no broadcasting
    assert kernels.hc_expand_rows(x, residual, post[:, :3], comb) is None
    assert kernels.hc_expand_rows(x, residual, post, torch._neg_view(comb)) is None
    x[0, 0] = math.nan
    assert kernels.hc_expand_rows(x, residual, post, comb) is None
    with torch.no_grad():  # and hc_expand runs the formula instead
        _assert_same((hc_expand(x, residual, post, comb),), (_expand_formula(x, residual, post, comb),))
