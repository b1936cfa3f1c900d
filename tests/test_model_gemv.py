"""Decode rows' products (`kvdiet.model.gemv`): compiled kernel and pure-torch path bit for bit, both equal to
the order written out one dot product at a time, and routed by `Linear` for a few CPU rows only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvdiet.model import gemv
from kvdiet.model.gemv import ROWS_MAX, linear, row_products, row_products_each
from kvdiet.model.linear import Linear


def _written_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The documented order with Python-level fp32 steps, one output at a time."""
    out = torch.empty(x.shape[0], w.shape[0])
    k = x.shape[1]
    for m in range(x.shape[0]):
        for n in range(w.shape[0]):
            lanes = torch.zeros(16)
            for start in range(0, k, 16):
                prod = torch.zeros(16)
                stop = min(k, start + 16)
                prod[: stop - start] = x[m, start:stop] * w[n, start:stop]  # each product rounded
                lanes = lanes + prod
            s8 = lanes[:8] + lanes[8:]
            s4 = s8[:4] + s8[4:]
            s2 = s4[:2] + s4[2:]
            out[m, n] = s2[0] + s2[1]
    return out


# one row: blocks of 16 weight rows (with a K tail, then 4- and 1-row remainders); more rows: blocks of 4
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 9, 37), (1, 53, 37), (1, 32, 128), (3, 13, 64), (5, 6, 15), (16, 7, 100), (4, 1, 16)],
)
def test_compiled_equals_pure_torch_and_the_written_out_order(both, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    # magnitudes over many octaves, so a different summation order would round differently
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 12, (m, k), generator=gen).float())
    w = torch.randn(n, k, generator=gen)
    compiled, pure = both(row_products, x, w)
    assert torch.equal(compiled, pure)
    assert torch.equal(compiled, _written_out(x, w))
    assert torch.allclose(compiled, x @ w.T, rtol=1e-4, atol=1e-3 * float(x.abs().max()))


def test_the_order_is_not_the_blas_sum():
    """The check above can fail: a plain sequential sum rounds differently on these inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (1, 256), generator=gen).float()
    )
    w = torch.randn(64, 256, generator=gen)
    sequential = torch.zeros(1, 64)
    for i in range(256):
        sequential = sequential + x[:, i : i + 1] * w[:, i][None]
    assert not torch.equal(row_products(x, w), sequential)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 131])  # row blocks of 4 and a remainder
def test_every_output_row_is_its_own_dot_product(n):
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(2, 48, generator=gen), torch.randn(n, 48, generator=gen)
    full = row_products(x, w)
    for j in range(n):
        assert torch.equal(full[:, j], row_products(x, w[j : j + 1])[:, 0])
    for m in range(2):  # and each input row the same alone as with others
        assert torch.equal(full[m], row_products(x[m : m + 1], w)[0])


def test_linear_routes_a_few_cpu_fp32_rows_and_leaves_the_rest_to_the_blas(both):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=gen)
    few = torch.randn(2, 3, 64, generator=gen)  # 6 rows in a batch shape
    compiled, pure = both(linear, few, w)
    assert torch.equal(compiled, pure)
    assert torch.equal(compiled, row_products(few.reshape(6, 64), w).view(2, 3, 40))
    assert torch.equal(linear(few.transpose(0, 1), w), compiled.transpose(0, 1))  # any layout of the rows
    many = torch.randn(ROWS_MAX + 1, 64, generator=gen)
    assert torch.equal(linear(many, w), F.linear(many, w))
    wide = w.double()
    assert linear(few.double(), wide).dtype == torch.float64  # an fp64 model keeps its products
    layer = Linear(64, 40)
    layer.set_weight(w)
    assert torch.equal(layer(few[0]), row_products(few[0], w))
    # lazily negated views (the storage holds the negation) go to the BLAS, which reads their values
    assert torch.equal(linear(torch._neg_view(-few), w), F.linear(few, w))
    assert torch.equal(linear(few, torch._neg_view(-w)), F.linear(few, w))


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.zeros(0, 8), torch.zeros(3, 8), "rows"),
        (torch.zeros(ROWS_MAX + 1, 8), torch.zeros(3, 8), "rows"),
        (torch.zeros(1, 8), torch.zeros(3, 9), r"x \[M, K\]"),
        (torch.zeros(1, 8, dtype=torch.float64), torch.zeros(3, 8), "fp32"),
    ],
)
def test_bad_input_is_refused(x, w, match):
    with pytest.raises(ValueError, match=match):
        row_products(x, w)


def test_the_pure_torch_path_bounds_its_temporaries(monkeypatch):
    """Passes over the weight's rows give the bits of one pass."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(50, 40, generator=gen)
    whole = gemv._torch_row_products(x, w)
    monkeypatch.setattr(gemv, "_TORCH_BUDGET", 3 * 16 * 7)  # 7 weight rows per pass
    assert torch.equal(gemv._torch_row_products(x, w), whole)


def test_row_products_each_gives_each_pairs_bits(both):
    """One call over pairs of different shapes (an MoE layer's experts) = one call per pair, on both paths."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(1, 7, 64), (3, 0, 16), (16, 33, 100), (2, 1, 5)]  # an empty weight and a lone row among them
    xs = [torch.randn(m, k, generator=gen) for m, _, k in shapes]
    ws = [torch.randn(n, k, generator=gen) for _, n, k in shapes]
    compiled, pure = both(row_products_each, xs, ws)
    for got, want, x, w in zip(compiled, pure, xs, ws, strict=True):
        assert torch.equal(got, want) and torch.equal(got, row_products(x, w))
        assert got.shape == (x.shape[0], w.shape[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_split_over_threads_keep_each_pairs_bits(both, threads):
    """Calls of 64K products or more (elements of w times rows of x) split over the threads, a batch of 16 rows
    of a small weight too: each pair's outputs are still its own products, in the written-out order."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(16, 67, 64), (5, 130, 48), (16, 9, 64), (1, 300, 32)]  # 68K, 31K, 9K and 9.6K products
    xs = [torch.randn(m, k, generator=gen) * 2.0 ** float(m % 7) for m, _, k in shapes]
    ws = [torch.randn(n, k, generator=gen) for _, n, k in shapes]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        compiled, pure = both(row_products_each, xs, ws)
        alone = row_products(xs[0], ws[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, _written_out(xs[0], ws[0]))
    for got, want, x, w in zip(compiled, pure, xs, ws, strict=True):
        assert torch.equal(got, want) and torch.equal(got, _written_out(x, w))


def test_row_products_each_names_the_bad_pair():
    good = torch.zeros(1, 8), torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"pair 1"):
        row_products_each([good[0], torch.zeros(1, 9)], [good[1], torch.zeros(2, 8)])
    with pytest.raises(ValueError, match="as many inputs as weights"):
        row_products_each([good[0]], [])


def test_gradients_and_default_dtype_do_not_change_the_path():
    """A row that needs grad keeps its graph (the BLAS); a float64 default dtype changes no output dtype."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(6, 32, generator=gen)
    x = torch.randn(2, 32, generator=gen, requires_grad=True)
    out = linear(x, w)
    assert out.grad_fn is not None
    out.sum().backward()
    assert torch.equal(x.grad, w.sum(0).expand(2, -1))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = row_products_each([x.detach()], [w])[0]
        pure = gemv._torch_row_products(x.detach(), w)
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == pure.dtype == torch.float32 and torch.equal(got, pure)


def test_applies_all_checks_the_rows_once_and_every_weight():
    """`applies_all(x, ws)` is `applies(x, w)` for every w: rows 1..ROWS_MAX of fp32 on the CPU, every weight a
    contiguous fp32 CPU tensor, nothing to track under grad mode, no lazily negated view."""
    w = torch.randn(8, 32)
    bad_weights = {
        "fp64": w.double(),
        "bf16": w.bfloat16(),
        "strided": torch.randn(32, 8).T,
        "meta": torch.empty(8, 32, device="meta"),
        "tracked": w.clone().requires_grad_(True),
        "negated": torch._neg_view(-w),
    }
    rows = {m: torch.randn(m, 32) for m in (1, ROWS_MAX, ROWS_MAX + 1)}
    rows["fp64"] = torch.randn(2, 32, dtype=torch.float64)
    rows["tracked"] = torch.randn(2, 32, requires_grad=True)
    rows["empty"] = torch.randn(0, 32)
    rows["negated"] = torch._neg_view(-torch.randn(2, 32))
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for name, x in rows.items():
                fits_x = name in (1, ROWS_MAX) or (name == "tracked" and not grad)
                assert gemv.applies_all(x, [w, w, w]) is fits_x, (name, grad)
                for bad_name, bad in bad_weights.items():
                    want = fits_x and bad_name == "tracked" and not grad
                    assert gemv.applies(x, bad) is want, (name, bad_name, grad)
                    assert gemv.applies_all(x, [w, bad, w]) is want, (name, bad_name, grad)
                assert gemv.applies_all(x, []) is fits_x


def test_lane_dots_is_row_products_per_batch_entry():
    """The batched pure-torch order (`gemv.lane_dots`, decode attention's path) on any layout: each entry's bits
    are `row_products`'s."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 37, generator=gen) * torch.exp2(
        torch.randint(-12, 12, (3, 5, 37), generator=gen).float()
    )
    w = torch.randn(3, 37, 22, generator=gen).transpose(1, 2)  # [3, 22, 37], strided
    got = gemv.lane_dots(x, w)
    assert got.shape == (3, 5, 22)
    for b in range(3):
        assert torch.equal(got[b], row_products(x[b], w[b].contiguous()))
