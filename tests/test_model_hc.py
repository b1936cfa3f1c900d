"""mHC coefficient and stream-mixing functions (v41-spec §8.1a)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model.hc import (
    add_sublayer_hc,
    hc_coefficients,
    hc_collapse,
    hc_expand,
    hc_init_streams,
    hc_initial_pre,
    sublayer_coefficients,
)
from kvdiet.model.transformer import Transformer

HC, HIDDEN, T = 4, 16, 5
RMS_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    n_mix = (2 + HC) * HC
    h = torch.randn(T, HC, HIDDEN, generator=g) * 3
    fn = torch.randn(n_mix, HC * HIDDEN, generator=g) * 0.3
    scale = torch.tensor([0.7, 1.3, 2.0])
    base = torch.randn(n_mix, generator=g)
    return h, fn, scale, base


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def _slow_coefficients(h, fn, scale, base):
    """One token at a time, Python floats and loops only."""
    out = []
    for t in range(h.shape[0]):
        flat = h[t].flatten().tolist()
        r = 1 / math.sqrt(sum(v * v for v in flat) / len(flat) + RMS_EPS)
        mixes = [sum(a * b for a, b in zip(flat, row, strict=True)) * r for row in fn.tolist()]
        b = base.tolist()
        s0, s1, s2 = scale.tolist()
        pre = [_sigmoid(mixes[i] * s0 + b[i]) + HC_EPS for i in range(HC)]
        post = [2 * _sigmoid(mixes[HC + i] * s1 + b[HC + i]) for i in range(HC)]
        logits = [
            [mixes[2 * HC + i * HC + j] * s2 + b[2 * HC + i * HC + j] for j in range(HC)] for i in range(HC)
        ]
        comb = []
        for row in logits:
            m = max(row)
            e = [math.exp(v - m) for v in row]
            comb.append([v / sum(e) + HC_EPS for v in e])

        def norm_cols(c):
            sums = [sum(c[i][j] for i in range(HC)) for j in range(HC)]
            return [[c[i][j] / (sums[j] + HC_EPS) for j in range(HC)] for i in range(HC)]

        def norm_rows(c):
            return [[v / (sum(row) + HC_EPS) for v in row] for row in c]

        comb = norm_cols(comb)
        for _ in range(ITERS - 1):
            comb = norm_cols(norm_rows(comb))
        out.append((pre, post, comb))
    return out


def _coefficients(h, fn, scale, base):
    return hc_coefficients(
        h, fn, scale, base, hc_mult=HC, rms_eps=RMS_EPS, hc_eps=HC_EPS, sinkhorn_iters=ITERS
    )


def test_coefficients_equal_slow_per_token_reference(inputs):
    pre, post, comb = _coefficients(*inputs)
    assert pre.shape == (T, HC) and post.shape == (T, HC) and comb.shape == (T, HC, HC)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for t, (p, q, c) in enumerate(_slow_coefficients(*inputs)):
        torch.testing.assert_close(pre[t], torch.tensor(p), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(post[t], torch.tensor(q), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb[t], torch.tensor(c), rtol=1e-4, atol=1e-6)


def _torch_formula(h, fn, scale, base):
    """The coefficients as plain torch ops, one per step of the docstring (what the model computed before
    its ops were fused)."""
    flat = h.flatten(-2)
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + RMS_EPS)
    pre = torch.sigmoid(mixes[..., :HC] * scale[0] + base[:HC]) + HC_EPS
    post = 2 * torch.sigmoid(mixes[..., HC : 2 * HC] * scale[1] + base[HC : 2 * HC])
    logits = (mixes[..., 2 * HC :] * scale[2] + base[2 * HC :]).unflatten(-1, (HC, HC))
    comb = torch.softmax(logits, dim=-1) + HC_EPS
    comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    for _ in range(ITERS - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(-2, keepdim=True) + HC_EPS)
    return pre, post, comb


# 1..9 and 33: every split of the pre/post/comb runs between the vector and the scalar tails of the CPU kernels
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 7, 8, 9, 33, 300])
def test_coefficients_equal_the_plain_torch_ops_bit_for_bit(inputs, tokens):
    _, fn, scale, base = inputs
    h = torch.randn(tokens, HC, HIDDEN, generator=torch.Generator().manual_seed(tokens)) * 3
    want = _torch_formula(h, fn, scale, base)
    for got, expected in zip(_coefficients(h, fn, scale, base), want, strict=True):
        assert torch.equal(got, expected)
    with torch.no_grad():  # up to MAX_MIX_ROWS tokens: the compiled call
        for got, expected in zip(_coefficients(h, fn, scale, base), want, strict=True):
            assert torch.equal(got, expected)
    block = _block(fn, scale, base)
    with torch.no_grad():  # the cached layout, twice (built, then reused)
        for _ in range(2):
            for got, expected in zip(_sublayer(block, h), want, strict=True):
                assert torch.equal(got, expected)
    assert block.hc_weights["attn"].source[0] is block.hc_attn_fn


def test_coefficients_of_fp64_streams_equal_the_plain_torch_ops(inputs):
    h, fn, scale, base = (t.double() for t in inputs)
    block = _block(*inputs[1:]).double()
    want = _torch_formula(h, fn, scale, base)
    with torch.no_grad():
        for got, expected in zip(_sublayer(block, h), want, strict=True):
            assert got.dtype == torch.float64 and torch.equal(got, expected)


def _block(fn, scale, base) -> nn.Module:
    """A module holding one sublayer's mHC parameters (``attn``) as the model's blocks do."""
    block = nn.Module()
    add_sublayer_hc(block, _CFG)
    with torch.no_grad():
        block.hc_attn_fn.copy_(fn)
        block.hc_attn_scale.copy_(scale)
        block.hc_attn_base.copy_(base)
    return block


def _sublayer(block, h):
    return sublayer_coefficients(block, _CFG, h, "attn")


_CFG = SimpleNamespace(
    hc_mult=HC, hidden_size=HIDDEN, rms_norm_eps=RMS_EPS, hc_eps=HC_EPS, hc_sinkhorn_iters=ITERS
)


def test_cached_layout_follows_every_way_the_parameters_change(inputs):
    """In place under no_grad, load_state_dict, a replaced parameter object (the checkpoint loader), new
    ``.data`` (what ``Module.to`` does) and ``.double()``: each is seen on the next call."""
    h, fn, scale, base = inputs
    block = _block(fn, scale, base)
    g = torch.Generator().manual_seed(7)

    def check(fn, scale, base, h=h):
        with torch.no_grad():
            got = _sublayer(block, h)
        for a, b in zip(got, _torch_formula(h, fn, scale, base), strict=True):
            assert torch.equal(a, b)

    check(fn, scale, base)
    fn2 = torch.randn(fn.shape, generator=g) * 0.3
    with torch.no_grad():
        block.hc_attn_fn.copy_(fn2)  # in place: the version counter
    check(fn2, scale, base)
    scale2 = torch.tensor([1.1, 0.4, 1.7])
    block.load_state_dict({**block.state_dict(), "hc_attn_scale": scale2})
    check(fn2, scale2, base)
    base2 = torch.randn(base.shape, generator=g)
    block._parameters["hc_attn_base"] = nn.Parameter(base2.clone(), requires_grad=False)  # a new object
    check(fn2, scale2, base2)
    fn3 = torch.randn(fn.shape, generator=g) * 0.3
    block.hc_attn_fn.data = fn3.clone()  # new storage, same object and version
    check(fn3, scale2, base2)
    block.double()
    check(fn3.double(), scale2.double(), base2.double(), h.double())


def test_with_autograd_the_parameters_are_read_directly(inputs):
    h, fn, scale, base = inputs
    block = _block(fn, scale, base)
    pre, _, _ = _sublayer(block, h)
    assert pre.requires_grad and "attn" not in block.hc_weights
    assert torch.equal(pre.detach(), _torch_formula(h, fn, scale, base)[0])


def test_comb_is_doubly_stochastic_and_ranges(inputs):
    h, fn, _, base = inputs
    pre, post, comb = _coefficients(h, fn, torch.tensor([0.7, 1.3, 0.3]), base)  # moderate comb logits
    torch.testing.assert_close(comb.sum(-2), torch.ones(T, HC), atol=1e-5, rtol=0)  # columns
    torch.testing.assert_close(comb.sum(-1), torch.ones(T, HC), atol=1e-3, rtol=0)  # rows
    assert bool((pre > HC_EPS).all() and (pre < 1 + HC_EPS).all())
    assert bool((post > 0).all() and (post < 2).all())
    assert bool((comb > 0).all())


def test_one_statistic_per_token_over_all_streams(inputs):
    h, fn, scale, base = inputs
    # scaling one token's streams as a whole leaves its coefficients unchanged (rsqrt over hc·hidden) ...
    scaled = h.clone()
    scaled[2] *= 10
    a, b = _coefficients(h, fn, scale, base), _coefficients(scaled, fn, scale, base)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    # ... but scaling only one stream changes them
    one = h.clone()
    one[2, 1] *= 10
    assert not torch.allclose(_coefficients(one, fn, scale, base)[0][2], a[0][2], atol=1e-4)


def test_leading_batch_dim(inputs):
    h, fn, scale, base = inputs
    batched = _coefficients(torch.stack([h, h.flip(0)]), fn, scale, base)
    single = _coefficients(h, fn, scale, base)
    for x, y in zip(batched, single, strict=True):
        torch.testing.assert_close(x[0], y, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("lead", [(1,), (2,), (5,), (300,), (2, 3)])
def test_collapse_and_expand_equal_the_plain_torch_ops_bit_for_bit(lead):
    g = torch.Generator().manual_seed(len(lead) * 1000 + lead[-1])
    h = torch.randn(*lead, HC, HIDDEN, generator=g) * 3
    x = torch.randn(*lead, HIDDEN, generator=g)
    pre, post = torch.rand(*lead, HC, generator=g), torch.rand(*lead, HC, generator=g) * 2
    comb = torch.softmax(torch.randn(*lead, HC, HC, generator=g), -1)
    assert torch.equal(hc_collapse(h, pre), (pre[..., None] * h).sum(-2))
    want = post[..., None] * x[..., None, :] + comb.transpose(-1, -2) @ h
    assert torch.equal(hc_expand(x, h, post, comb), want)


def test_collapse_and_expand_match_loops(inputs):
    h, fn, scale, base = inputs
    pre, post, comb = _coefficients(h, fn, scale, base)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(1))
    collapsed = hc_collapse(h, pre)
    expanded = hc_expand(x, h, post, comb)
    assert collapsed.shape == (T, HIDDEN) and expanded.shape == (T, HC, HIDDEN)
    for t in range(T):
        torch.testing.assert_close(
            collapsed[t], sum(pre[t, i] * h[t, i] for i in range(HC)), rtol=1e-5, atol=1e-6
        )
        for i in range(HC):
            want = post[t, i] * x[t] + sum(comb[t, j, i] * h[t, j] for j in range(HC))
            torch.testing.assert_close(expanded[t, i], want, rtol=1e-5, atol=1e-5)


def test_expand_uses_columns_of_comb():
    residual = torch.tensor([[[1.0], [10.0]]])  # T=1, hc=2, hidden=1
    comb = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])  # comb[0, 1] = 1: stream 0 feeds output stream 1
    out = hc_expand(torch.zeros(1, 1), residual, torch.zeros(1, 2), comb)
    assert out.flatten().tolist() == [0.0, 1.0]


def test_init_streams_and_initial_pre():
    x = torch.arange(6.0).view(2, 3)
    streams = hc_init_streams(x, 4)
    assert streams.shape == (2, 4, 3) and all(streams[:, i].equal(x) for i in range(4))
    streams[0, 1, 0] = 99.0  # a real copy, not a view
    assert x[0, 0] == 0
    pre = hc_initial_pre(2, 4)
    assert pre.tolist() == [[1.0, 0.0, 0.0, 0.0]] * 2
    assert hc_collapse(hc_init_streams(x, 4), pre).equal(x)


def test_shape_errors(inputs):
    h, fn, scale, base = inputs
    with pytest.raises(ValueError, match="hc_mult"):
        hc_coefficients(h, fn, scale, base, hc_mult=2, rms_eps=RMS_EPS, hc_eps=HC_EPS, sinkhorn_iters=ITERS)
    with pytest.raises(ValueError, match="fn"):
        _coefficients(h, fn[:-1], scale, base)


def test_inference_mode_parameters_are_laid_out_on_every_call():
    """Parameters made under inference mode keep no version counter: the coefficients still come out, equal to
    those of ordinary parameters, and nothing is cached for them."""
    from torch import nn

    from kvdiet.config import load_config
    from kvdiet.model.hc import add_sublayer_hc, sublayer_coefficients

    cfg = load_config("v4.1-micro")
    gen = torch.Generator().manual_seed(2)
    plain = nn.Module()
    add_sublayer_hc(plain, cfg)
    with torch.no_grad():
        plain.hc_attn_fn.normal_(generator=gen)
    h = torch.randn(3, cfg.hc_mult, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        want = sublayer_coefficients(plain, cfg, h, "attn")
    with torch.inference_mode():
        block = nn.Module()
        add_sublayer_hc(block, cfg)
        block.hc_attn_fn.copy_(plain.hc_attn_fn)
        got = sublayer_coefficients(block, cfg, h, "attn")
    assert block.hc_weights == {}
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("native_kernels", ["1", "0"])
def test_a_scale_written_through_data_is_read_at_the_next_step(monkeypatch, native_kernels) -> None:
    """A write to an mHC scale's storage (``.data``: no version counter moves) after the layout was kept and a
    decode step bound it: the next step reads the new scales (the kept layout holds the parameter itself, not a
    copy), the same logits as the same write made in place with autograd's knowledge, on both paths."""
    monkeypatch.setenv(native.ENV, native_kernels)
    got = []
    for through_data in (True, False):
        model = Transformer.from_config(load_config("v4.1-micro"), seed=4)
        state = model.new_state()
        model.prefill(state, torch.arange(2, 30))
        with torch.no_grad():
            for block in model.layers:
                block.hc_attn_fn.normal_(std=0.1, generator=torch.Generator().manual_seed(5))
        model.decode([state], [5])
        with torch.no_grad():
            scale = model.layers[2].hc_attn_scale
            (scale.data if through_data else scale).mul_(3)
        got.append(model.decode([state], [6]))
    assert torch.equal(got[0], got[1])
