"""The compiled softmax of narrow and wide rows (``formats/softmax_kernels.cpp``) against torch.softmax: the same
bits over adversarial rows, torch.softmax wherever the kernel declines, and `attend` unchanged with it."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvdiet.formats import native
from kvdiet.model import narrow_softmax
from kvdiet.model.attention import attend
from kvdiet.model.decode_attend import decode_attend
from kvdiet.model.narrow_softmax import WIDTH_MAX, kernel_agrees, softmax_last


def _kernels():
    kernels = native.fp4_kernels()
    assert kernels is not None, "the compiled kernels did not build"
    return kernels


def _rows(shape: tuple[int, ...], gen: torch.Generator, scale: float) -> torch.Tensor:
    """Logits as attention makes them: normal values at ``scale``, a fifth of them −inf (masked keys), ±0,
    subnormals and exact ties, the last column finite (the sink)."""
    x = torch.randn(shape, generator=gen) * scale
    pool = torch.tensor([-math.inf, -math.inf, 0.0, -0.0, 1e-45, -3e-39, 0.5])
    chosen = torch.rand(shape, generator=gen) < 0.25
    x[chosen] = pool[torch.randint(len(pool), (int(chosen.sum()),), generator=gen)]
    x[..., -1] = torch.randn(shape[:-1], generator=gen)
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _assert_torchs_bits(kernel, cases, scales, threads: int, seed: int) -> None:
    """``kernel(x)`` gives torch.softmax's bits on `_rows` of every ``(shapes)`` of ``cases`` at every scale, run at
    ``threads`` torch threads."""
    gen = torch.Generator().manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shapes in cases:
            for shape in shapes:
                for scale in scales:
                    x = _rows(shape, gen, scale)
                    got = kernel(x)
                    assert got is not None
                    assert _same_bits(got, torch.softmax(x, -1)), (shape, scale)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_rows_equals_torch_softmax_at_every_narrow_width(threads):
    # every width 1..15 (torch's reduction under one vector), scales from all-underflow to all-ties, on 1 to
    # 4,099 rows (split over the threads); the exp is torch's Sleef exp, the sum left to right
    cases = [((1, n), (4099, n), (37, 4, n)) for n in range(1, WIDTH_MAX + 1)]
    _assert_torchs_bits(_kernels().softmax_rows, cases, (1e-30, 1.0, 8.0, 1e3, 1e30), threads, seed=threads)
    assert kernel_agrees()


def test_softmax_rows_declines_what_torch_must_compute():
    kernels = _kernels()
    x = torch.randn(5, 13)
    for bad in (
        torch.full((5, 13), math.nan),  # NaN in
        torch.cat([x[:, :12], torch.full((5, 1), math.inf)], 1),  # +inf: inf − inf
        torch.full((5, 13), -math.inf),  # a row of −inf only
        torch.randn(5, 16),  # one whole vector: torch's vector reduction, another order
        torch.randn(13, 5).t(),  # not contiguous
        x.double(),
    ):
        assert kernels.softmax_rows(bad) is None
        assert _same_bits(softmax_last(bad), torch.softmax(bad, -1)) if bad.dtype == torch.float32 else True
    one_nan = x.clone()
    one_nan[3, 2] = math.nan  # one row NaN: the whole call goes to torch
    assert kernels.softmax_rows(one_nan) is None
    got = softmax_last(one_nan)
    assert torch.isnan(got[3]).all() and torch.equal(got[:3], torch.softmax(x[:3], -1))


def test_softmax_last_runs_the_kernel_only_where_it_agrees(monkeypatch, caplog):
    gen = torch.Generator().manual_seed(0)
    x = _rows((64, 4, 13), gen, 4.0)
    calls = []
    kernels = _kernels()
    spy = type("Spy", (), {"softmax_rows": lambda self, v: calls.append(1) or kernels.softmax_rows(v)})()
    monkeypatch.setattr(native, "fp4_kernels", lambda: spy)
    assert _same_bits(softmax_last(x), torch.softmax(x, -1)) and calls == [1]
    assert (
        _same_bits(softmax_last(x[..., :12].contiguous()), torch.softmax(x[..., :12], -1)) and len(calls) == 2
    )
    softmax_last(torch.randn(4, 16))  # too wide: torch's
    softmax_last(x.transpose(0, 1))  # not contiguous: torch's
    assert len(calls) == 2
    # a torch whose softmax rounds otherwise (one ulp up): the check fails, warns, and torch's runs
    torch_softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda v, dim: torch_softmax(v, dim).nextafter_(torch.tensor(2.0)))
    kernel_agrees.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=narrow_softmax.__name__):
            assert not kernel_agrees()
            checked = len(calls)  # the check's own kernel calls
            assert _same_bits(softmax_last(x), torch.softmax(x, -1)) and len(calls) == checked
        assert "differs from torch.softmax" in caplog.text
    finally:
        monkeypatch.undo()
        kernel_agrees.cache_clear()
    assert kernel_agrees()


def test_attend_of_a_prefill_has_the_same_bits_without_the_kernels(monkeypatch):
    # a prefill's band: 300 queries × 4 heads over 8 window keys and 4 selected entries (+ sink = 13 logits),
    # masked slots in both, against the pure-torch path
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(300, 4, 64, generator=gen)
    win = torch.randn(300, 8, 64, generator=gen)
    comp = torch.randn(300, 4, 64, generator=gen)
    win_mask = torch.rand(300, 8, generator=gen) < 0.7
    comp_mask = torch.rand(300, 4, generator=gen) < 0.6
    win_mask[:5] = False  # rows with only the sink and the selection
    sink = torch.randn(4, generator=gen)
    for c, cm in ((comp, comp_mask), (None, None)):
        compiled = attend(q, win, win_mask, c, cm, sink, 0.125)
        monkeypatch.setenv(native.ENV, "0")
        assert _same_bits(compiled, attend(q, win, win_mask, c, cm, sink, 0.125))
        monkeypatch.delenv(native.ENV)


# widths around whole vectors and their tails, v4.1-mini's decode logits (128 + 512 + 1), and long rows
_WIDE = [*range(16, 50), 63, 64, 65, 127, 128, 129, 255, 640, 641, 642, 1000, 2049, 4097]


@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_wide_equals_torch_softmax_at_wide_widths(threads):
    # torch's vector reduction (16 lanes, a last partial vector, the AVX-512 fold) on 1 to 300 rows (a few hundred
    # rows of 641 split over the threads), from all-underflow to all-ties, with −inf keys, ±0 and subnormals
    kernels = _kernels()
    assert kernels.softmax_wide_agrees()
    cases = [((1, n), (3, 4, n), (300, n)) if n in (641, 4097) else ((1, n), (3, 4, n)) for n in _WIDE]
    _assert_torchs_bits(
        kernels.softmax_wide, cases, (1e-30, 1.0, 8.0, 100.0, 1e30), threads, seed=10 + threads
    )


def test_softmax_wide_declines_what_torch_must_compute():
    kernels = _kernels()
    x = torch.randn(5, 641)
    one_nan = x.clone()
    one_nan[3, 200] = math.nan  # one row with a NaN: the whole call goes to torch
    for bad in (
        torch.full((5, 641), math.nan),  # NaN in
        one_nan,
        torch.cat([x[:, :640], torch.full((5, 1), math.inf)], 1),  # +inf: inf − inf
        torch.full((5, 641), -math.inf),  # a row of −inf only
        torch.randn(5, 15),  # under one vector: softmax_rows' order
        torch.randn(641, 5).t(),  # not contiguous
        x.double(),
    ):
        assert kernels.softmax_wide(bad) is None


def test_decode_attention_takes_the_wide_softmax_with_torchs_bits(monkeypatch):
    # v4.1-mini's decode shape: 4 heads over 128 window keys and 512 entries (+ sink), one and three requests,
    # masked slots in both, against the pure-torch path
    gen = torch.Generator().manual_seed(2)
    for b in (1, 3):
        q = torch.randn(b, 4, 512, generator=gen)
        win = torch.randn(b, 128, 512, generator=gen)
        comp = torch.randn(b, 512, 512, generator=gen).bfloat16()
        win_mask = torch.rand(b, 128, generator=gen) < 0.8
        comp_mask = torch.rand(b, 512, generator=gen) < 0.9
        sink = torch.randn(4, generator=gen)
        compiled = decode_attend(q, win, win_mask, comp, comp_mask, sink, 0.044)
        monkeypatch.setenv(native.ENV, "0")
        assert _same_bits(compiled, decode_attend(q, win, win_mask, comp, comp_mask, sink, 0.044)), b
        monkeypatch.delenv(native.ENV)
