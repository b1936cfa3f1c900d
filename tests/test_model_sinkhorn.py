"""The compiled Sinkhorn normalisation (``model.sinkhorn``) against the pure-torch path and the formula, bit
for bit; and mHC coefficients unchanged by it."""

from __future__ import annotations

import platform

import pytest
import torch

from kvdiet.formats.native import ENV
from kvdiet.model import sinkhorn
from kvdiet.model.hc import hc_coefficients

EPS = 1e-6


def _formula(comb: torch.Tensor, iters: int, eps: float = EPS) -> torch.Tensor:
    """v41-spec §8.1a spelled out, out of place."""
    comb = comb + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _softmax_rows(n: int, hc: int, dtype: torch.dtype, spread: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, hc, hc, generator=g, dtype=dtype) * spread, dim=-1)


def _both(comb: torch.Tensor, iters: int, monkeypatch: pytest.MonkeyPatch, eps: float = EPS):
    monkeypatch.delenv(ENV, raising=False)
    native = sinkhorn.sinkhorn_(comb.clone(), eps=eps, iters=iters)
    monkeypatch.setenv(ENV, "0")
    plain = sinkhorn.sinkhorn_(comb.clone(), eps=eps, iters=iters)
    monkeypatch.delenv(ENV)
    return native, plain


def test_the_kernel_builds_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert sinkhorn.sinkhorn_kernel() is not None, "the Sinkhorn kernel did not build"
    monkeypatch.setenv(ENV, "0")
    assert sinkhorn.sinkhorn_kernel() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hc", [1, 2, 3, 4])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_kernel_equals_torch_and_the_formula_bit_for_bit(dtype, hc, iters, monkeypatch):
    # spread 8: near one-hot rows, tiny entries next to large ones (many rounding cases)
    for n, spread in ((1, 1.0), (3, 8.0), (997, 3.0)):
        comb = _softmax_rows(n, hc, dtype, spread)
        native, plain = _both(comb, iters, monkeypatch)
        want = _formula(comb, iters)
        assert native.dtype == dtype and native.shape == comb.shape
        assert torch.equal(native, want) and torch.equal(plain, want)


def test_in_place_and_leading_dims(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    comb = _softmax_rows(12, 4, torch.float32, 2.0).view(3, 4, 4, 4)
    want = _formula(comb, 20)
    out = sinkhorn.sinkhorn_(comb, eps=EPS, iters=20)
    assert out is comb and torch.equal(comb, want)
    empty = torch.empty(0, 4, 4)
    assert sinkhorn.sinkhorn_(empty, eps=EPS, iters=20).shape == (0, 4, 4)


def test_outside_the_kernel_the_torch_path_runs(monkeypatch):
    """hc > 4 (torch's sums split into partials there), a strided view and autograd take the torch loop."""
    monkeypatch.delenv(ENV, raising=False)
    wide = _softmax_rows(50, 6, torch.float32, 3.0)
    assert torch.equal(sinkhorn.sinkhorn_(wide.clone(), eps=EPS, iters=20), _formula(wide, 20))
    base = _softmax_rows(20, 4, torch.float32, 3.0, seed=1)
    strided = base[::2]
    assert not strided.is_contiguous()
    want = _formula(strided, 20)
    assert torch.equal(sinkhorn.sinkhorn_(strided, eps=EPS, iters=20), want)
    leaf = base.clone().requires_grad_()
    sinkhorn.sinkhorn_(leaf * 1, eps=EPS, iters=3).sum().backward()
    assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all())


def test_eps_zero_and_larger_eps(monkeypatch):
    comb = _softmax_rows(40, 4, torch.float32, 5.0, seed=2)
    for eps in (0.0, 1e-3):
        native, plain = _both(comb, 20, monkeypatch, eps=eps)
        want = _formula(comb, 20, eps)
        assert torch.equal(native, want) and torch.equal(plain, want)


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_one_matrix_at_a_time_and_whole_blocks_agree_with_the_formula(hc, monkeypatch):
    """Counts either side of the kernel's split (a last block of fewer than 4 fp32 matrices goes one at a
    time, more go 16 side by side), on entries that stress the rounding: zeros, subnormals, huge values."""
    values = torch.tensor([0.0, 1e-45, 3e-39, 1e-38, 1e-7, 0.3, 1.0, 7.0, 1e30, 3e38])
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 35):
        comb = values[torch.randint(0, values.numel(), (n, hc, hc), generator=g)]
        for iters in (1, 3, 20):
            native, plain = _both(comb, iters, monkeypatch)
            want = _formula(comb, iters)
            assert torch.equal(native, want) and torch.equal(plain, want), (n, iters)


@pytest.mark.parametrize("tokens", [1, 37])
def test_hc_coefficients_do_not_depend_on_the_path(tokens, monkeypatch):
    g = torch.Generator().manual_seed(3)
    hc, hidden = 4, 64
    h = torch.randn(tokens, hc, hidden, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * hidden, generator=g) * 0.05
    scale, base = torch.tensor([0.9, 1.1, 2.5]), torch.randn((2 + hc) * hc, generator=g)
    runs = []
    for env in ("1", "0"):
        monkeypatch.setenv(ENV, env)
        runs.append(
            hc_coefficients(h, fn, scale, base, hc_mult=hc, rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
        )
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _softmax_then_sinkhorn(logits: torch.Tensor, iters: int, eps: float = EPS) -> torch.Tensor:
    return _formula(torch.softmax(logits.contiguous(), dim=-1), iters, eps)


def test_softmax_sinkhorn_uses_torchs_vector_exp_where_torch_has_one(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    known = platform.machine() == "x86_64" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if not known:
        pytest.skip("torch runs no AVX2/AVX512 kernels here: softmax_sinkhorn takes torch's softmax")
    # found, and it passed its own check against torch.softmax
    assert sinkhorn._torch_vector_exp() is not None


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
@pytest.mark.parametrize("iters", [1, 20])
def test_softmax_sinkhorn_equals_softmax_then_sinkhorn_bit_for_bit(hc, iters, monkeypatch):
    g = torch.Generator().manual_seed(10 * hc + iters)
    for n, spread in ((1, 1.0), (5, 8.0), (997, 3.0), (64, 40.0)):
        # the logits as the model holds them: a column slice of a wider row (rows apart, entries contiguous)
        wide = torch.randn(n, 3 * hc + hc * hc, generator=g) * spread
        logits = wide[:, 3 * hc :].view(n, hc, hc)
        want = _softmax_then_sinkhorn(logits, iters)
        for env in ("1", "0"):
            monkeypatch.setenv(ENV, env)
            got = sinkhorn.softmax_sinkhorn(logits, eps=EPS, iters=iters)
            assert got.is_contiguous() and got.shape == (n, hc, hc) and torch.equal(got, want), (n, env)
    monkeypatch.delenv(ENV)


def test_softmax_sinkhorn_elsewhere_takes_torchs_softmax(monkeypatch):
    """fp64, leading dims and tensors that need grad go through torch.softmax and `sinkhorn_`."""
    monkeypatch.delenv(ENV, raising=False)
    g = torch.Generator().manual_seed(4)
    for logits in (
        torch.randn(30, 4, 4, generator=g, dtype=torch.float64) * 3,
        torch.randn(2, 15, 4, 4, generator=g) * 3,
        torch.randn(0, 4, 4),
    ):
        got = sinkhorn.softmax_sinkhorn(logits, eps=EPS, iters=20)
        assert got.dtype == logits.dtype and torch.equal(got, _softmax_then_sinkhorn(logits, 20))
    leaf = torch.randn(6, 4, 4, generator=g).requires_grad_()
    got = sinkhorn.softmax_sinkhorn(leaf * 1, eps=EPS, iters=3)
    assert got.requires_grad and torch.equal(got.detach(), _softmax_then_sinkhorn(leaf.detach(), 3))


def _plain_mix(mixes, mean_sq, scale, base, hc, iters):
    """`hc_mix`'s steps as the torch ops of v41-spec §8.1a, one op each."""
    z = mixes * (mean_sq[:, None] + 1e-6).rsqrt() * scale + base
    pre = torch.sigmoid(z[:, :hc].contiguous()) + EPS
    post = torch.sigmoid(z[:, hc : 2 * hc].contiguous())
    comb = torch.softmax(z[:, 2 * hc :].reshape(-1, hc, hc), dim=-1)
    return pre, post + post, _formula(comb, iters)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize(
    "rows", [1, 3, 4, 8, 9, 33, 256]
)  # sigmoid runs of hc·rows: every vector/scalar split
def test_hc_mix_equals_the_plain_torch_ops_bit_for_bit(hc, rows, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    g = torch.Generator().manual_seed(rows * 10 + hc)
    n_mix = (2 + hc) * hc
    mixes = torch.randn(rows, n_mix, generator=g) * 20
    mean_sq = torch.rand(rows, generator=g) * 4 + 0.01
    scale = torch.tensor([0.7] * hc + [1.3] * hc + [2.0] * hc * hc)
    base = torch.randn(n_mix, generator=g)
    want = _plain_mix(mixes, mean_sq, scale, base, hc, 20)
    got = sinkhorn.hc_mix(mixes.clone(), mean_sq, scale, base, rms_eps=1e-6, hc_eps=EPS, iters=20)
    if sinkhorn._torch_vector_exp() is None:
        assert got is None
        return
    assert got is not None
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_hc_mix_declines_what_it_does_not_take(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    mixes, mean_sq = torch.randn(2, 24), torch.rand(2) + 0.1
    scale, base = torch.ones(24), torch.zeros(24)

    def mix(m, q=mean_sq):
        return sinkhorn.hc_mix(m, q, scale, base, rms_eps=1e-6, hc_eps=EPS, iters=20)

    assert mix(torch.randn(sinkhorn.MAX_MIX_ROWS + 1, 24), torch.rand(sinkhorn.MAX_MIX_ROWS + 1)) is None
    assert mix(mixes.double(), mean_sq.double()) is None
    assert mix(mixes.clone(), mean_sq.double()) is None
    assert mix(torch.randn(24, 2).T) is None  # not contiguous
    assert mix(torch.randn(2, 48)) is None  # hc 6
    monkeypatch.setenv(ENV, "0")
    assert mix(mixes.clone()) is None


def test_compiled_paths_hold_under_a_float64_default_dtype(monkeypatch):
    """The self-check and the outputs are fp32 whatever torch's default dtype (a model run in fp64 elsewhere)."""
    monkeypatch.delenv(ENV, raising=False)
    g = torch.Generator().manual_seed(5)
    mixes, mean_sq = torch.randn(3, 24, generator=g) * 5, torch.rand(3, generator=g) + 0.1
    scale, base = torch.ones(24) * 1.5, torch.randn(24, generator=g)
    want = _plain_mix(mixes, mean_sq, scale, base, 4, 20)
    found = sinkhorn._torch_vector_exp() is not None
    previous = torch.get_default_dtype()
    sinkhorn._torch_vector_exp.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        assert (sinkhorn._torch_vector_exp() is not None) == found
        got = sinkhorn.hc_mix(mixes.clone(), mean_sq, scale, base, rms_eps=1e-6, hc_eps=EPS, iters=20)
    finally:
        torch.set_default_dtype(previous)
        sinkhorn._torch_vector_exp.cache_clear()
    if found:
        assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_hc_mix_declines_arguments_that_do_not_fit():
    """Wrong lengths, a mix count that is no (2+hc)·hc, or a tensor off the CPU: None, nothing written."""
    from kvdiet.model.sinkhorn import hc_mix

    kw = {"rms_eps": 1e-6, "hc_eps": 1e-6, "iters": 3}
    buf = torch.full((15,), 5.0)
    assert hc_mix(buf[:14].view(2, 7), torch.ones(2), torch.full((8,), 3.0), torch.zeros(8), **kw) is None
    mixes = torch.randn(2, 24)
    assert hc_mix(mixes, torch.ones(3), torch.ones(24), torch.zeros(24), **kw) is None
    assert hc_mix(mixes, torch.ones(2), torch.ones(23), torch.zeros(24), **kw) is None
    assert hc_mix(mixes, torch.ones(2), torch.ones(24, device="meta"), torch.zeros(24), **kw) is None
    assert float(buf[-1]) == 5.0
