"""The compiled small products (``formats/chain_kernels.cpp``: ``chain_bmm``, ``chain_mm``) against ``torch.bmm`` and
``torch.mm``: the same bits at the shapes kvdiet uses, an order that operands tell apart, the per-shape checks and
their fallbacks; ``chain_mm`` against its own definition, computed exactly."""

from __future__ import annotations

import itertools
import logging
import math
from fractions import Fraction

import pytest
import torch

from kvdiet.formats import native
from kvdiet.model import chain_products
from kvdiet.model.chain_products import (
    CHAIN_MM_ROWS,
    FOUR_LANES,
    MKL_BLOCK,
    TORCH_LOOP_BELOW,
    ChainForm,
    batched_product,
    chain_agrees,
    chain_class,
    chain_fits,
    product_block,
    product_fits,
    weight_block,
)


def _kernels():
    kernels = native.fp4_kernels()
    assert kernels is not None, "the compiled kernels did not build"
    return kernels


def _agrees(*shape: object, single: bool = False) -> ChainForm:
    """`chain_agrees` at a shape class under torch's matmul precision and thread count at this moment."""
    return chain_agrees(*shape, torch.get_float32_matmul_precision(), torch.get_num_threads(), single=single)


def _form(a: torch.Tensor, w: torch.Tensor) -> ChainForm:
    """The verdict `batched_product` acts on for ``bmm(a, w)``: its class, one batch or more."""
    return _agrees(*chain_class(a, w), single=a.shape[0] == 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _values(shape: tuple[int, ...], gen: torch.Generator, case: int) -> torch.Tensor:
    """fp32 ``shape``: case 0 normal draws; 1 at scales 2^-140..2^40 (subnormal products) with a fifth of them ±0
    or halves of small integers (exact products whose sums meet rounding ties); 2 at scales up to 2^70
    (overflowing products) with ±inf among those."""
    if case == 0:
        return torch.randn(shape, generator=gen)
    top = 41 if case == 1 else 71
    x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-140, top, shape, generator=gen).float()
    infs = () if case == 1 else (math.inf, -math.inf)
    pool = torch.tensor([0.0, -0.0, *infs, 0.5, -1.5, 3.0, 2.5])
    chosen = torch.rand(shape, generator=gen) < 0.2
    x[chosen] = pool[torch.randint(len(pool), (int(chosen.sum()),), generator=gen)]
    return x


# (a [B, M, K] as made from a contiguous tensor, w [B, K, N] likewise): mHC's combᵀ·residual, attention's
# probs·window and probs·selected (a slice of the probabilities), a wide decode row and one with a lane tail;
# then attention's scores q·keysᵀ (both operands' k contiguous: 16 batches a vector from batch 16), with
# partial k chunks and output blocks
_SHAPES = [
    ("cols", 4, 4, 64, "rows"),
    ("slice", 4, 8, 64, "rows"),
    ("slice", 4, 4, 64, "rows"),
    ("cols", 4, 4, 1024, "rows"),
    ("rows", 16, 8, 72, "rows"),
    ("rows", 5, 3, 37, "cols"),
    ("rows", 4, 64, 8, "cols"),
    ("rows", 4, 64, 4, "cols"),
    ("slice", 5, 33, 7, "cols"),
    ("rows", 8, 64, 8, "cols"),
    ("rows", 3, 64, 8, "cols"),
]


def _operands(
    layout_a: str, m: int, k: int, n: int, layout_w: str, batch: int, gen: torch.Generator, case: int
):
    a = _values((batch, m, k), gen, case)
    if layout_a == "cols":
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout_a == "slice":
        a = torch.cat([a, _values((batch, m, 5), gen, case)], -1)[..., :k]
    w = _values((batch, k, n), gen, case)
    if layout_w == "cols":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    return a, w


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3, 16, 17, 256])
@pytest.mark.parametrize(("layout_a", "m", "k", "n", "layout_w"), _SHAPES)
def test_chain_equals_torch_bmm_bit_for_bit(layout_a, m, k, n, layout_w, batch, threads):
    kernels = _kernels()
    gen = torch.Generator().manual_seed(batch * 1000 + m * 100 + k * 10 + n)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ran = 0
        for case in range(3):
            a, w = _operands(layout_a, m, k, n, layout_w, batch, gen, case)
            want = torch.bmm(a, w)
            got = kernels.chain_bmm(a, w, **_form(a, w).kernel_flags)
            if want.isnan().any() or _declined(a, w):  # inf · 0 or inf − inf; keys outside the batch lanes
                assert got is None
                with torch.no_grad():  # torch.bmm runs them
                    assert torch.equal(_bits(batched_product(a, w)), _bits(want))
                continue
            ran += 1
            assert got.shape == want.shape and got.is_contiguous()
            _assert_chain_or_kept(got, want, a, w, case)
            with torch.no_grad():
                assert torch.equal(_bits(batched_product(a, w)), _bits(want))
        assert ran >= 2 or _declined(a, w)
    finally:
        torch.set_num_threads(old)


def _assert_chain_or_kept(
    got: torch.Tensor, want: torch.Tensor, a: torch.Tensor, w: torch.Tensor, case: int
) -> None:
    """The kernel's result ``got`` (in the form the check found, where it found one) against torch.bmm's ``want``:
    bit for bit where the check finds this machine's BLAS summing as the kernel does at this shape class (and then
    `batched_product` takes the kernel); elsewhere (e.g. MKL's Zen code path on an AMD EPYC at q · keysᵀ) the
    caller keeps torch.bmm, and on plain operands (case 0) the two orders stay within their rounding bounds of each
    other: 2k·2⁻²⁴·Σ|a·w|."""
    if _form(a, w):
        assert torch.equal(_bits(got), _bits(want))
    elif case == 0:
        bound = 2 * a.shape[2] * 2.0**-24 * torch.bmm(a.abs(), w.abs())
        assert bool(((got - want).abs() <= bound).all())


def _declined(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Operands holding k contiguously (q · keysᵀ) that the batch lanes do not take (fewer than 16 batches, more
    than 64 outputs a matrix): one output at a time would be slower than torch.bmm, so the kernel declines them."""
    keys = a.stride(2) == 1 and w.stride(1) == 1 and w.stride(2) != 1
    return keys and (a.shape[0] < 16 or a.shape[1] * w.shape[2] > 64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [16, 37, 256])
def test_scores_of_overlapping_window_bands_equal_torch_bmm(batch, threads):
    """A prefill's window scores: q [T, H, D] · bandᵀ, the band [T, W, D] each query's W keys as overlapping
    views of one key sequence (row stride D, batch stride D): the batch-lane path's rows read in place."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(batch)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case in range(2):
            q = _values((batch, 4, 64), gen, case)
            keys = _values((batch + 7, 64), gen, case)
            band = keys.as_strided((batch, 8, 64), (64, 64, 1))
            want = torch.bmm(q, band.transpose(1, 2))
            assert not want.isnan().any()
            got = kernels.chain_bmm(q, band.transpose(1, 2), **_form(q, band.transpose(1, 2)).kernel_flags)
            _assert_chain_or_kept(got, want, q, band.transpose(1, 2), case)
            with torch.no_grad():
                assert torch.equal(_bits(batched_product(q, band.transpose(1, 2))), _bits(want))
    finally:
        torch.set_num_threads(old)


def test_the_order_is_one_fused_chain_from_plus_zero():
    """Operands where the orders differ: (−(1 + 2^-11)) + (1 + 2^-12)² is 2^-24 summed as one fused chain, 0 with
    the square rounded first (to 1 + 2^-11: a tie to even), and a chain of −0 products from +0 is +0 (from the
    first product it would be −0); torch.bmm gives the chain's values, and so does the kernel."""
    kernels = _kernels()
    x = 1 + 2.0**-12
    a = torch.tensor([[-1.0, x]]).expand(4, 2).repeat(3, 1, 1)  # [3, 4, 2]: 4·2·64 multiply-adds, MKL's path
    w = torch.tensor([[1 + 2.0**-11], [x]]).expand(2, 64).repeat(3, 1, 1)  # [3, 2, 64]
    rounded = (a[..., :1] * w[:, :1]) + (a[..., 1:] * w[:, 1:])  # products rounded, then added
    assert torch.equal(rounded, torch.zeros(3, 4, 64))
    want = torch.bmm(a, w)
    assert torch.equal(want, torch.full((3, 4, 64), 2.0**-24))
    assert torch.equal(_bits(kernels.chain_bmm(a, w)), _bits(want))
    zeros = kernels.chain_bmm(torch.ones(3, 4, 2), torch.full((3, 2, 64), -0.0))
    assert torch.equal(_bits(zeros), _bits(torch.zeros(3, 4, 64)))
    assert torch.equal(_bits(zeros), _bits(torch.bmm(torch.ones(3, 4, 2), torch.full((3, 2, 64), -0.0))))


@pytest.mark.parametrize(
    ("layout_a", "m", "k", "n", "layout_w"),
    [
        *_SHAPES[:5],
        ("rows", 2, 8, 64, "rows"),  # 2 rows: the generic vector loop (v4.1-micro's heads)
        (
            "rows",
            5,
            6,
            40,
            "rows",
        ),  # depth 6 and a row past the groups of 4: the generic loop, 8 tail columns
        ("rows", 4, 64, 8, "cols"),  # q · keysᵀ: the batch lanes
    ],
)
def test_the_settled_form_is_the_chain_plus_zero(layout_a, m, k, n, layout_w):
    """``settle_zero``: each output of the chain with +0 added: −0 outputs read +0, every other bit kept, on every
    path of the kernel (fixed depths, the generic vector loop, the scalar tail columns, the batch lanes)."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(7)
    for case in range(2):
        a, w = _operands(layout_a, m, k, n, layout_w, 17, gen, case)
        # batch 0's output columns 0 and n − 1: chains of negative products each below half the least subnormal
        # (each −0 alone)
        a[0] = 2.0**-80
        w[0, :, 0] = w[0, :, -1] = -(2.0**-80)
        plain, settled = kernels.chain_bmm(a, w), kernels.chain_bmm(a, w, settle_zero=True)
        negative_zero = _bits(plain) == -(2**31)
        assert bool(negative_zero[0, :, 0].all()) and bool(negative_zero[0, :, -1].all())
        assert torch.equal(_bits(settled), _bits(plain + 0.0))
        assert torch.equal(
            _bits(settled)[negative_zero], torch.zeros(int(negative_zero.sum()), dtype=torch.int32)
        )
        assert torch.equal(_bits(settled)[~negative_zero], _bits(plain)[~negative_zero])


@pytest.mark.parametrize(
    ("layout_a", "m", "k", "n", "layout_w"),
    [
        ("rows", 4, 1, 512, "rows"),  # 1-long chains: the fixed-depth path (probabilities · a 1-entry window)
        ("cols", 4, 4, 64, "rows"),  # fixed depth 4
        ("rows", 5, 6, 40, "rows"),  # the generic loop, a row past the groups of 4, 8 tail columns
        ("rows", 4, 64, 8, "cols"),  # q · keysᵀ: the batch lanes
    ],
)
def test_the_form_from_negative_zero_is_the_chain_from_its_first_product(layout_a, m, k, n, layout_w):
    """``start_negative``: each chain starts from −0, so its first step is the first product rounded alone (−0 kept):
    a 1-long chain is the plain product; longer ones differ from the chain from +0 only where both end at a zero
    (a chain of −0 products: −0 here, +0 from +0), on every path of the kernel."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(11)
    for case in range(2):
        a, w = _operands(layout_a, m, k, n, layout_w, 17, gen, case)
        a[0], w[0] = a[0].abs(), -w[0].abs() * 0.0  # batch 0: every product −0
        negative, plain = kernels.chain_bmm(a, w, start_negative=True), kernels.chain_bmm(a, w)
        assert bool((_bits(negative)[0] == -(2**31)).all()) and bool((_bits(plain)[0] == 0).all())
        zero = plain == 0
        assert torch.equal(_bits(negative)[~zero], _bits(plain)[~zero])
        assert bool((_bits(negative)[zero] & 0x7FFFFFFF == 0).all())  # a zero there too, of either sign
        if k == 1:
            assert torch.equal(_bits(negative), _bits(a * w))


def test_one_batch_is_a_class_of_its_own():
    """MKL may sum one batch (one sgemm) otherwise than several (a batched call): on an AMD EPYC [1, 4, 1] ·
    [1, 1, 512] is the rounded product and [3, 4, 1] · [3, 1, 512] the settled chain. Each gets its own verdict,
    and `batched_product` gives torch.bmm's bits at both, whatever this machine's BLAS does."""
    chain_agrees.cache_clear()
    gen = torch.Generator().manual_seed(5)
    for batch in (1, 3, 16):
        for case in range(2):
            a, w = _operands("rows", 4, 1, 512, "rows", batch, gen, case)
            w[0, 0, :8] = -0.0  # −0 products among the rest
            with torch.no_grad():
                assert torch.equal(_bits(batched_product(a, w)), _bits(torch.bmm(a, w)))
    assert chain_agrees.cache_info().currsize == 2  # one verdict for one batch, one for more


def test_shapes_torch_sums_otherwise_keep_torch_bmm(caplog):
    """Below `TORCH_LOOP_BELOW` multiply-adds a matrix torch's own loop rounds each product before its sum:
    batched_product leaves such shapes to torch.bmm quietly, and the check, asked, finds the chain wrong there."""
    kernels = _kernels()
    chain_agrees.cache_clear()
    a = torch.tensor([[[-1.0, 1 + 2.0**-12]]]).expand(1, 2, 2).contiguous()  # [1, 2, 2] · [1, 2, 3]: 12
    w = torch.tensor([[[1 + 2.0**-11] * 3, [1 + 2.0**-12] * 3]])
    assert TORCH_LOOP_BELOW == 4 * 2 * 50  # torch's threshold, held below
    assert torch.equal(torch.bmm(a, w), torch.zeros(1, 2, 3))  # rounded products
    assert torch.equal(kernels.chain_bmm(a, w), torch.full((1, 2, 3), 2.0**-24))
    with caplog.at_level(logging.INFO, logger=chain_products.__name__), torch.no_grad():
        assert torch.equal(batched_product(a, w), torch.zeros(1, 2, 3))
        assert chain_agrees.cache_info().currsize == 0 and caplog.text == ""  # not even checked
        assert not _agrees(*chain_class(a, w))
    assert "differs from torch.bmm" in caplog.text
    # at a BLAS shape the verdict is which form of the chain this machine's BLAS sums as: here on random operands
    # and on one whose products all underflow (the FMA chain ends at -0; MKL's Zen code path adds +0 after it)
    shuffled = torch.randn(16, 4, 4), torch.randn(16, 4, 64)
    tiny = torch.zeros(16, 4, 4), torch.zeros(16, 4, 64)
    tiny[0][0, 2] = torch.tensor([0.0, 0.0, 1.267866824551808e-40, -0.0])
    tiny[1][0, :, 12] = torch.tensor([-0.7866698503494263, 1.3900021314620972, -9.006201282154172e-40, 20.0])
    agree = {False: True, True: True}  # settle_zero -> every probe's bits equal torch.bmm's
    for left, right in (shuffled, tiny):
        left = left.transpose(1, 2).contiguous().transpose(1, 2)  # the class's layout: columns of a
        for settle in agree:
            got = kernels.chain_bmm(left, right, settle_zero=settle)
            agree[settle] &= torch.equal(_bits(got), _bits(torch.bmm(left, right)))
    assert torch.equal(_bits(kernels.chain_bmm(tiny[0], tiny[1]))[0, 2, 12], torch.tensor(-(2**31)))  # -0
    settled = kernels.chain_bmm(tiny[0], tiny[1], settle_zero=True)
    assert torch.equal(_bits(settled)[0, 2, 12], torch.tensor(0))  # +0
    assert agree[False] != agree[True] or not agree[False]  # the all-underflow probe tells the forms apart
    form = ChainForm.CHAIN if agree[False] else ChainForm.SETTLED if agree[True] else ChainForm.NONE
    assert _agrees(4, 4, 64, True, False) is form
    # where torch's BLAS starts: the chain's bits there (the cancelling pair of the test above, at 4·2·50 = 400)
    a, w = a[:, :1].expand(1, 4, 2).contiguous(), w[:, :, :1].expand(1, 2, 50).contiguous()
    assert torch.equal(torch.bmm(a, w), torch.full((1, 4, 50), 2.0**-24))
    assert torch.equal(torch.bmm(a[:, :, :], w[:, :, :49]), torch.zeros(1, 4, 49))  # 392: torch's loop


def test_fallbacks_and_refusals(monkeypatch):
    kernels = _kernels()
    a, w = torch.randn(2, 4, 4), torch.randn(2, 4, 64)
    assert kernels.chain_bmm(a, w) is not None
    assert kernels.chain_bmm(a.double(), w.double()) is None
    assert kernels.chain_bmm(a, w[:1]) is None  # no broadcasting
    assert kernels.chain_bmm(a, w[:, :3]) is None
    assert (
        kernels.chain_bmm(torch.randn(2, 4, 65), torch.randn(2, 65, 8)) is None
    )  # deeper than the chain's cap
    assert kernels.chain_bmm(torch._neg_view(a), w) is None  # a lazy negation: its data is not its value
    nan = w.clone()
    nan[1, 2, 3] = math.nan
    assert kernels.chain_bmm(a, nan) is None
    with torch.no_grad():
        assert torch.equal(batched_product(a, nan).isnan(), torch.bmm(a, nan).isnan())
        monkeypatch.setenv(native.ENV, "0")  # switched off: the kernel is not even looked at
        with monkeypatch.context() as m:
            m.setattr(chain_products, "chain_agrees", _refuse)
            assert torch.equal(_bits(batched_product(a, w)), _bits(torch.bmm(a, w)))
        monkeypatch.delenv(native.ENV)
        with monkeypatch.context() as m:  # fp64, or autograd: torch.bmm without a check
            m.setattr(chain_products, "chain_agrees", _refuse)
            assert batched_product(a.double(), w.double()).dtype == torch.float64
    a.requires_grad_(True)
    out = batched_product(a, w)  # autograd on: torch.bmm itself
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError):
        batched_product(torch.randn(2, 4, 4), torch.randn(2, 5, 64))


def test_a_candidate_is_taken_only_on_checks_it_ran_and_matched(caplog):
    """`_first_agreeing`: a candidate declining a check (None) leaves that check to the reference for itself alone:
    the candidates after it are still compared on it (a wrong one fails there), and one that declined every check
    is never taken; a check every candidate declines is skipped."""
    a, w = torch.ones(1, 2), torch.ones(2, 3)
    checks = [("first", a, w), ("second", a, 2 * w)]
    right = lambda a, w, c: None if c == "shy" else torch.mm(a, w)  # noqa: E731
    wrong_after_a_decline = lambda a, w, c: (  # noqa: E731
        None if (c == "shy" or (c == "late" and w[0, 0] == 1)) else torch.mm(a, w) + (c == "late")
    )
    agreeing = chain_products._first_agreeing
    assert agreeing({"shy": "shy", "ok": "ok"}, checks, right, torch.mm, "k", (1, 2, 3, False, False)) == "ok"
    # "late" declines the first check and is wrong on the second: the check after a decline still fails it
    assert (
        agreeing({"late": "late", "ok": "ok"}, checks, wrong_after_a_decline, torch.mm, "k", (1,) * 5) == "ok"
    )
    assert agreeing({"shy": "shy"}, checks, right, torch.mm, "k", (1, 2, 3, False, False)) is None
    with caplog.at_level(logging.INFO, logger="kvdiet.model.chain_products"):
        assert agreeing({"late": "late"}, checks, wrong_after_a_decline, torch.mm, "k", (1,) * 5) is None
    assert "late: second" in caplog.text


def test_four_lanes_take_an_infinite_first_value():
    """The packed four-lane path multiplies only lane 0 by a[0]: an infinite a[0] gives the definition's ±inf, not a
    NaN from the zeros beside it (which would decline)."""
    kernels = _kernels()
    if native.cpu_isa() != "AVX512":
        return
    a = torch.rand(1, 2) + 1
    a[0, 0] = float("inf")
    w = (torch.rand(2, 6) + 1).t().contiguous().t()  # k contiguous: the packed path
    got = kernels.chain_mm(a, w, FOUR_LANES)
    assert got is not None and torch.equal(_bits(got), _bits(_four_lanes(a, w)))


def _refuse(*args: object) -> bool:
    raise AssertionError(f"chain_agrees called with {args}")


@pytest.mark.parametrize("default", ["float64", "meta"])
def test_the_check_builds_fp32_cpu_operands_whatever_torchs_defaults(default):
    """Torch's default dtype fp64, or a default device (a forward on another device sets one): the check still
    runs on fp32 CPU operands and passes, and its verdict is the one under plain defaults."""
    _kernels()
    chain_agrees.cache_clear()
    plain = _agrees(4, 4, 48, True, False)
    chain_agrees.cache_clear()
    old = torch.get_default_dtype()
    try:
        if default == "float64":
            torch.set_default_dtype(torch.float64)
            assert _agrees(4, 4, 48, True, False) == plain
        else:
            with torch.device("meta"):
                assert _agrees(4, 4, 48, True, False) == plain
    finally:
        torch.set_default_dtype(old)
        chain_agrees.cache_clear()


def test_the_verdict_is_kept_per_matmul_precision_and_thread_count():
    """A check under one fp32 matmul precision or thread count does not answer for another (MKL splits some shapes
    by thread count): chain_fits asks again."""
    _assert_verdict_kept(chain_fits, chain_agrees, (4, 4, 64, True, False), (4, 4, 32, True, False))


def _assert_verdict_kept(fits, cached, shape: tuple, other: tuple) -> None:
    """``fits(*shape)`` asks ``cached(*shape, precision, threads)`` once per fp32 matmul precision and intra-op
    thread count, and ``cached`` refuses a precision or thread count that is not torch's now (``other``: a class
    not asked before, so the check itself runs)."""
    _kernels()
    cached.cache_clear()
    old, threads = torch.get_float32_matmul_precision(), torch.get_num_threads()
    try:
        first = fits(*shape)  # a verdict (the BLAS's order decides which) under "highest"
        assert cached.cache_info().currsize == 1
        torch.set_float32_matmul_precision("medium")
        fits(*shape)
        assert cached.cache_info().currsize == 2
        with pytest.raises(ValueError, match="precision 'highest'"):
            cached(*other, "highest", threads)
        torch.set_float32_matmul_precision(old)
        torch.set_num_threads(1 if threads > 1 else 2)
        fits(*shape)
        assert cached.cache_info().currsize == 3
        with pytest.raises(ValueError, match=f"checking on {threads} threads"):
            cached(*other, old, threads)
        torch.set_num_threads(threads)
        assert fits(*shape) == first
        assert cached.cache_info().currsize == 3  # the first verdict again
    finally:
        torch.set_float32_matmul_precision(old)
        torch.set_num_threads(threads)
        cached.cache_clear()


def _round_fp32(x: Fraction, negative_zero: bool) -> float:
    """The fp32 nearest ``x`` (ties to even), ±inf past the largest; an exact 0 is −0 where ``negative_zero``."""
    if x == 0:
        return -0.0 if negative_zero else 0.0
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    q, r = divmod(a / quantum, 1)
    n = int(q) + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and int(q) % 2) else 0)
    value = n * quantum
    if value >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(value)  # n <= 2^24 times a power of two: exact in fp64 and in fp32


def _fma32(x: float, y: float, acc: float) -> float:
    """fp32 fma(x, y, acc): the exact x·y + acc rounded once (finite operands); an exact 0 is −0 only where x·y
    and acc are both −0 or the exact sum is a nonzero that rounds to 0 from below (IEEE 754's rules)."""
    exact = Fraction(x) * Fraction(y) + Fraction(acc)
    product_negative_zero = x * y == 0 and math.copysign(1.0, x) * math.copysign(1.0, y) < 0
    negative_zero = product_negative_zero and math.copysign(1.0, acc) < 0
    return _round_fp32(exact, negative_zero)


def _blocked_chains(a: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """chain_mm's definition, exactly: out[m, n] = P_0 + P_1 + ... (fp32 adds in order, P_0 as it is), P_b the fp32
    FMA chain from +0 over block b's k in increasing k; blocks of ``block`` (the last the rest), a K of more than one
    and at most two blocks in halves (the first ceil(K / 2))."""
    k = a.shape[1]
    starts = [0, (k + 1) // 2] if block < k <= 2 * block else list(range(0, k, block))
    bounds = [*starts, k]
    out = torch.empty(a.shape[0], w.shape[1])
    for i in range(a.shape[0]):
        for j in range(w.shape[1]):
            total = None
            for b0, b1 in itertools.pairwise(bounds):
                acc = 0.0
                for kk in range(b0, b1):
                    acc = _fma32(float(a[i, kk]), float(w[kk, j]), acc)
                total = acc if total is None else float(torch.tensor(total) + torch.tensor(acc))
            out[i, j] = total
    return out


def _mm_operands(m: int, k: int, n: int, w_layout: str, gen: torch.Generator, case: int):
    """a [m, k] (rows padded: a slice) and w [k, n] in ``w_layout``: "rows" (n contiguous), "cols" (k contiguous: a
    transposed weight) or "strided" (neither); case 0 normal draws, 1 `_values`' zeros, subnormal products and
    ties (finite: the definition takes finite operands), 2 underflowing products (below)."""
    a = _values((m, k + 3), gen, case % 2)[:, :k]
    w = _values((n, k), gen, case % 2)
    if case == 2:  # every product nonzero, negative, below half the least subnormal: each rounds to −0 alone
        a, w = a.abs() * 2.0**-80, -(w.abs() * 2.0**-80)
    if w_layout == "rows":
        return a, w.t().contiguous()
    if w_layout == "cols":
        return a, w.t()
    return a, torch.cat([w.t(), w.t()], 1)[:, ::2]


@pytest.mark.parametrize("w_layout", ["rows", "cols", "strided"])
@pytest.mark.parametrize(
    ("m", "k", "n", "block"),
    [
        (1, 1, 1, MKL_BLOCK),  # one product
        (1, 37, 24, MKL_BLOCK),  # one chain (K <= block), a 16 + 8 output split, a partial chunk of k
        (3, 30, 17, 16),  # one to two blocks: halves, 15 + 15
        (2, 31, 5, 16),  # halves of an odd K: 16 + 15, the first the longer
        (1, 16, 5, 16),  # K = block: one chain
        (1, 32, 5, 16),  # K = 2 · block: two halves, which are the two blocks
        (5, 50, 8, 16),  # blocks of 16, 16, 16, then 2; a row past the groups of 4
        (16, 33, 3, 8),  # sixteen rows; five blocks, the last one value
    ],
)
@pytest.mark.parametrize("case", [0, 1, 2])
def test_chain_mm_is_its_blocked_fma_chains(m, k, n, block, w_layout, case):
    """Every output bit for bit as `_blocked_chains` computes it exactly, zeros' signs included (case 2: chains of
    underflowing −0 products end at −0, and the first block is taken as it is, not added to +0)."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n + case)
    a, w = _mm_operands(m, k, n, w_layout, gen, case)
    got = kernels.chain_mm(a, w, block)
    if native.cpu_isa() != "AVX512":  # the kernel needs AVX-512: the callers keep torch.mm
        assert got is None
        return
    want = _blocked_chains(a, w, block)
    assert got.shape == (m, n) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))
    if case == 2:
        assert bool(torch.signbit(got).all())


def _four_lanes(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """chain_mm's four-lane form, exactly (fp32 operations one at a time): each product rounded; k = 0 and then k = 1,
    5, 9, … added to lane 0, k = 2, 6, … to lane 1, and so on up to k = 4q, each lane from +0 in increasing k; the
    lanes summed as (0 + 2) + (1 + 3); then the last (K − 1) mod 4 products added in order."""
    k = a.shape[1]
    tail = 1 + (k - 1) // 4 * 4
    out = torch.empty(a.shape[0], w.shape[1])
    for i in range(a.shape[0]):
        products = a[i, :, None] * w  # [k, n] fp32, each rounded once
        lanes = [torch.zeros(w.shape[1]) for _ in range(4)]
        for kk in range(tail):
            lane = 0 if kk == 0 else (kk - 1) % 4
            lanes[lane] = lanes[lane] + products[kk]
        total = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
        for kk in range(tail, k):
            total = total + products[kk]
        out[i] = total
    return out


@pytest.mark.parametrize("w_layout", ["rows", "cols", "strided"])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 1, 1),  # one product: lane 0 alone
        (1, 4, 5),  # no whole group of four: k = 1 .. 3 the tail
        (1, 5, 24),  # one group; six vectors of four outputs, two groups of twelve
        (1, 1024, 24),  # v4.1-mini's mHC coefficients: [1, 4·256] · fn_t [1024, 24], three products the tail
        (1, 1024, 64),  # v4.1-mini's output projection of one group: [1, 1024] · wo_aᵀ [1024, 64]
        (3, 30, 17),  # rows side by side; 17 outputs (the last vector of four holds one)
        (16, 45, 7),  # sixteen rows; groups of 16 k with a partial last chunk of whole groups
    ],
)
@pytest.mark.parametrize("case", [0, 1, 2])
def test_chain_mm_four_lanes_is_its_definition(m, k, n, w_layout, case):
    """With block `FOUR_LANES` and w holding k contiguously (a transposed weight, the layout MKL's order was found
    for) every output bit for bit as `_four_lanes` computes it, zeros' signs included (case 2: every product −0, so
    each lane sum from +0 reads +0, and so do the outputs); any other layout of w is declined."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n + case)
    a, w = _mm_operands(m, k, n, w_layout, gen, case)
    got = kernels.chain_mm(a, w, FOUR_LANES)
    if (
        native.cpu_isa() != "AVX512" or w.stride(0) != 1
    ):  # rows of one value hold k contiguously in every layout
        assert got is None
        return
    assert got.shape == (m, n) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(_four_lanes(a, w)))
    if case == 2:
        assert not bool(torch.signbit(got).any())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("m", "k", "n", "w_layout"),
    [
        (1, 1024, 24, "cols"),  # v4.1-mini's mHC coefficients: [B, 4·256] · fn_t [1024, 24]
        (16, 1024, 24, "cols"),
        (3, 256, 24, "cols"),  # v4.1-micro's and the tiny plan's (one chain)
        (2, 385, 24, "cols"),  # one to two blocks: halves
        (1, 2000, 24, "cols"),  # five blocks, the last a partial one
        (4, 256, 8, "cols"),  # a router-shaped product, x · weightᵀ
        (5, 64, 40, "rows"),
    ],
)
def test_chain_mm_gives_torch_mm_bits_where_its_check_holds(m, k, n, w_layout, threads):
    """Where `product_fits` finds chain_mm in MKL_BLOCK-long blocks (or one chain) giving torch.mm's bits at a
    class, it does on other operands of that class (random and adversarial); where it finds none (another BLAS or
    code path), the two orders stay within their rounding bounds of each other."""
    kernels = _kernels()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(m * k * n + threads)
        cols = w_layout == "cols"
        block = product_fits(m, k, n, False, cols)
        assert block in (0, MKL_BLOCK, k, FOUR_LANES)
        agree = (
            native.cpu_isa() == "AVX512"
        )  # whether chain_mm in MKL_BLOCK blocks gave torch.mm's bits on each
        for case in range(3):
            a, w = _mm_operands(m, k, n, w_layout, gen, case)
            want = torch.mm(a, w)
            if block:
                assert torch.equal(_bits(kernels.chain_mm(a, w, block)), _bits(want))
            elif native.cpu_isa() == "AVX512":
                got = kernels.chain_mm(a, w, MKL_BLOCK)
                agree &= torch.equal(_bits(got), _bits(want))
                if case == 0:
                    assert bool(((got - want).abs() <= 2 * k * 2.0**-24 * torch.mm(a.abs(), w.abs())).all())
        # a BLAS that sums these as the blocked chains (random, adversarial and underflowing operands alike) must
        # not be refused by the check
        assert block or not agree
    finally:
        torch.set_num_threads(old)


def test_chain_mm_declines_what_it_does_not_fit():
    kernels = _kernels()
    a, w = torch.randn(2, 40), torch.randn(40, 24)
    if native.cpu_isa() != "AVX512":
        assert kernels.chain_mm(a, w, MKL_BLOCK) is None
        return
    assert kernels.chain_mm(a, w, MKL_BLOCK) is not None
    assert kernels.chain_mm(a.double(), w.double(), MKL_BLOCK) is None
    assert kernels.chain_mm(a, w[:39], MKL_BLOCK) is None  # k differs
    assert kernels.chain_mm(torch.randn(CHAIN_MM_ROWS + 1, 40), w, MKL_BLOCK) is None
    assert kernels.chain_mm(a[:, :0], w[:0], MKL_BLOCK) is None  # no k
    assert kernels.chain_mm(a, w, 0) is None
    assert kernels.chain_mm(a, w, -3) is None  # a negative block other than FOUR_LANES
    assert (
        kernels.chain_mm(torch._neg_view(a), w, MKL_BLOCK) is None
    )  # a lazy negation: its data is not its value
    assert kernels.chain_mm(a[None], w[None], MKL_BLOCK) is None
    nan = w.clone()
    nan[3, 5] = math.nan
    assert kernels.chain_mm(a, nan, MKL_BLOCK) is None  # which NaN a chain keeps is not torch's to match
    assert product_fits(CHAIN_MM_ROWS + 1, 40, 24, False, False) == 0
    assert product_fits(0, 40, 24, False, False) == 0


def test_the_product_verdict_is_kept_per_matmul_precision_and_thread_count():
    """product_block answers once per class, precision and thread count (MKL may split by thread count), and
    weight_block's verdict for a count of rows is product_fits' at its class, for more than one row (None) the block
    every count of 2..16 rows found."""
    _assert_verdict_kept(product_fits, product_block, (1, 300, 24, False, True), (1, 301, 24, False, True))
    weight_t = torch.empty(24, 300).t()  # a transposed weight's view: k contiguous
    try:
        first = product_fits(1, 300, 24, False, True)
        assert weight_block(1, weight_t) == first
        assert weight_block(3, weight_t.contiguous()) == product_fits(3, 300, 24, False, False)
        each = {product_fits(m, 300, 24, False, True) for m in range(2, CHAIN_MM_ROWS + 1)}
        assert weight_block(None, weight_t) == (each.pop() if len(each) == 1 else 0)
        assert weight_block(CHAIN_MM_ROWS + 1, weight_t) == 0
    finally:
        product_block.cache_clear()
