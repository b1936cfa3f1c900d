"""An attention layer's projections of decode rows in one compiled call each (`kvdiet.model.fused_rows`,
``formats/projection_kernels.cpp``) against the module path (Linear, RMSNorm, Rotation.apply, grouped_product
one by one): same bits, and the module path wherever the call does not fit."""

from __future__ import annotations

import math

import pytest
import torch

from kvdiet.formats import native
from kvdiet.formats.mxfp4 import INDEX_KEY
from kvdiet.model import fused_rows
from kvdiet.model.build import load_model

_SPECIALS = (0.0, -0.0, math.inf, -math.inf, 1e-45, -3e-39, 1e-38, 1e19, 1e-19)


@pytest.fixture(scope="module")
def attn():
    model, _ = load_model("v4.1-mini", seed=0)  # the real widths: 4 heads × 512, rope 64, q rank 128
    return model.layers[5].attn


def _rows(n: int, width: int, gen: torch.Generator, *, specials: bool) -> torch.Tensor:
    x = torch.randn(n, width, generator=gen) * 10.0 ** torch.randint(-8, 8, (n, 1), generator=gen).float()
    if specials:
        chosen = torch.rand(n, width, generator=gen) < 0.05
        pool = torch.tensor(_SPECIALS)
        x[chosen] = pool[torch.randint(len(pool), (int(chosen.sum()),), generator=gen)]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _module_path(attn, x, o, rot):
    return (*attn.project_q(x, rot), attn.project_window_kv(x, rot), attn.project_out(o, rot))


def _fused(attn, x, o, rot):
    q = fused_rows.project_rows(x, attn.wq_a, attn.q_norm, attn.wq_b, attn.n_heads, attn.head_dim, rot)
    kv = fused_rows.project_rows(x, attn.wkv, attn.kv_norm, None, 1, attn.head_dim, rot)
    out = fused_rows.project_out_rows(o, rot, attn.wo_a, attn.wo_b, attn.n_groups)
    return q, kv, out


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("specials", [False, True])
def test_projections_equal_the_module_path_bit_for_bit(attn, rows, specials):
    assert native.fp4_kernels() is not None, "the compiled kernels did not build"
    gen = torch.Generator().manual_seed(rows + 100 * specials)
    x = _rows(rows, attn.wq_a.in_features, gen, specials=specials)
    o = _rows(rows * attn.n_heads, attn.head_dim, gen, specials=specials).view(rows, attn.n_heads, -1)
    rot = attn.rope.at(torch.randint(0, 1 << 20, (rows,), generator=gen))
    with torch.no_grad():
        want = _module_path(attn, x, o, rot)
        q, kv, out = _fused(attn, x, o, rot)
        q_t, kv_t, out_t = _fused(attn, x.T.contiguous().T, o, rot)
    # the compiled calls ran wherever the result holds no NaN (a NaN is where a kernel may decline)
    assert q is not None or want[0].isnan().any() or want[1].isnan().any()
    assert kv is not None or want[2].isnan().any()
    assert out is not None or want[3].isnan().any()
    if not specials:
        assert q is not None and kv is not None and out is not None
    got = [*(q or (None, None)), None if kv is None else kv[1], out]
    got += [*(q_t or (None, None)), None if kv_t is None else kv_t[1], out_t]
    for g, w in zip(got, (*want, *want), strict=True):
        if g is None:
            continue
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        assert torch.equal(_bits(g), _bits(w))
    assert q is None or q[1].shape == (rows, attn.n_heads, attn.head_dim)


def test_projections_keep_the_module_path_where_the_call_does_not_fit(attn, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    rot17 = attn.rope.at(torch.arange(17))
    x = _rows(17, attn.wq_a.in_features, gen, specials=False)
    with torch.no_grad():
        proj_q = (attn.wq_a, attn.q_norm, attn.wq_b, attn.n_heads, attn.head_dim)
        assert fused_rows.project_rows(x, *proj_q, rot17) is None  # a prefill's rows
        nan = x[:2].clone()
        nan[0, 0] = math.nan
        proj_kv = (attn.wkv, attn.kv_norm, None, 1, attn.head_dim)
        assert fused_rows.project_rows(nan, *proj_kv, attn.rope.at(torch.arange(2))) is None
        o = torch.randn(2, attn.n_heads, attn.head_dim)
        args = (
            attn.rope.at(torch.arange(2)).cis_inverse,
            64,
            attn.wo_a.weight,
            attn.n_groups,
            attn.wo_b.weight,
        )
        kernels = native.fp4_kernels()
        assert kernels.project_out_rows(o, *args) is not None
        assert kernels.project_out_rows(o.transpose(0, 2).contiguous().transpose(0, 2), *args) is None
        assert kernels.project_out_rows(torch.randn(17, attn.n_heads, attn.head_dim), *args) is None
        assert kernels.project_out_rows(o, *args[:3], 3, args[4]) is None  # groups that do not divide
        assert kernels.project_out_rows(o, *args[:4], attn.wo_a.weight) is None  # wo_b of the wrong width
        x2, rot2 = x[:2], attn.rope.at(torch.arange(2))
        proj = (attn.wq_a.weight, attn.q_norm.weight, attn.q_norm.eps, attn.wq_b.weight, attn.n_heads)
        assert kernels.project_rows(x2, *proj, attn.head_dim, rot2.cis, 64) is not None
        assert kernels.project_rows(x2, *proj, attn.head_dim // 2, rot2.cis, 64) is None  # wq_b is not H × D
        monkeypatch.setenv(native.ENV, "0")
        assert fused_rows.project_rows(x[:2], *proj_kv, attn.rope.at(torch.arange(2))) is None
    _, q = attn.project_q(x[:2], attn.rope.at(torch.arange(2)))  # autograd on: the modules keep the graph
    assert q.grad_fn is not None


@pytest.fixture(scope="module")
def indexed():
    model, _ = load_model("v4.1-mini", seed=0)
    attn = model.layers[2].attn  # a KV source: it owns an indexer
    return attn, model.codecs.index_key


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("specials", [False, True])
def test_index_queries_equal_the_module_path_bit_for_bit(indexed, monkeypatch, rows, specials):
    from kvdiet.model.indexer import Indexer

    attn, codec = indexed
    gen = torch.Generator().manual_seed(50 + rows + 100 * specials)
    qr = _rows(rows, attn.indexer.wq_b.in_features, gen, specials=False)
    x = _rows(rows, attn.indexer.weights_proj.in_features, gen, specials=specials)
    rot = attn.rope.at(torch.randint(0, 1 << 20, (rows,), generator=gen))
    with torch.no_grad():
        fused = attn.indexer._fused_queries(qr, x, rot, codec)
        got = attn.indexer.queries(qr, x, rot, codec)
        with monkeypatch.context() as m:
            m.setattr(Indexer, "_fused_queries", lambda *a: None)
            want = attn.indexer.queries(qr, x, rot, codec)
    assert fused is not None  # the compiled call ran
    for g, w in zip((*got, *fused), (*want, *want), strict=True):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        assert torch.equal(_bits(g), _bits(w))


def test_index_queries_report_a_non_finite_query_as_before(indexed):
    attn, codec = indexed
    qr = torch.randn(2, attn.indexer.wq_b.in_features)
    qr[1, 0] = math.inf
    with torch.no_grad():
        assert (
            attn.indexer._fused_queries(qr, torch.randn(2, 256), attn.rope.at(torch.arange(2)), codec) is None
        )
        with pytest.raises(ValueError, match="mxfp4"):
            attn.indexer.queries(qr, torch.randn(2, 256), attn.rope.at(torch.arange(2)), codec)


def test_index_queries_decline_a_codec_of_another_width(indexed):
    attn, codec = indexed
    idx, rot = attn.indexer, attn.rope.at(torch.arange(2))
    qr, x = torch.randn(2, idx.wq_b.in_features), torch.randn(2, idx.weights_proj.in_features)
    kernels = native.fp4_kernels()
    args = (
        qr,
        idx.wq_b.weight,
        idx.n_heads,
        idx.index_head_dim,
        rot.cis,
        rot.rope_dim,
        x,
        idx.weights_proj.weight,
    )
    with torch.no_grad():
        lo, hi = INDEX_KEY.scale_bytes
        tail = (idx.softmax_scale, INDEX_KEY.kernel, lo, hi)
        assert kernels.index_query_rows(*args, *tail, codec.width) is not None
        assert kernels.index_query_rows(*args, *tail, codec.width + 34) is None  # entries of 192 dims
        assert (
            kernels.index_query_rows(*args, *tail, codec.width - 34) is None
        )  # of 64: would write past them
        half = (qr, idx.wq_b.weight, idx.n_heads, idx.index_head_dim // 2, *args[4:])
        assert kernels.index_query_rows(*half, *tail, codec.width // 2) is None  # wq_b is not H × d


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("specials", [False, True])
def test_index_keys_equal_the_module_path_bit_for_bit(indexed, monkeypatch, rows, specials):
    """`Indexer.keys` of a decode step's groups runs in one ``project_rows`` call (where no output is NaN) with
    the bits of ``rot.apply(k_norm(wk(latent)))``; other calls (prefill, the reference) run the modules."""
    from kvdiet.model import indexer as indexer_module

    attn, _ = indexed
    idx = attn.indexer
    gen = torch.Generator().manual_seed(70 + rows + 100 * specials)
    latent = _rows(rows, idx.wk.in_features, gen, specials=specials)
    rot = attn.rope.at(torch.randint(0, 1 << 20, (rows,), generator=gen))
    calls = []
    fused = fused_rows.project_rows
    monkeypatch.setattr(indexer_module, "project_rows", lambda *a: calls.append(a) or fused(*a))
    with torch.no_grad():
        assert torch.equal(_bits(idx.keys(latent, rot)), _bits(rot.apply(idx.k_norm(idx.wk(latent)))))
        assert not calls  # prefill and the reference take the modules
        got = idx.keys(latent, rot, decode_step=True)
        want = rot.apply(idx.k_norm(idx.wk(latent)))
        ran = len(calls) == 1 and fused(*calls[0]) is not None  # the compiled call gave the result
    assert ran or want.isnan().any()
    assert ran or specials
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert torch.equal(_bits(got), _bits(want))


def test_index_keys_run_the_modules_hooks(indexed):
    """A forward hook on ``wk`` (or one on every module) is honoured: the keys are the hooked module path's."""
    from torch.nn.modules import module as nn_module

    attn, _ = indexed
    idx = attn.indexer
    latent = torch.randn(2, idx.wk.in_features, generator=torch.Generator().manual_seed(3))
    rot = attn.rope.at(torch.tensor([4, 9]))
    with torch.no_grad():
        plain = idx.keys(latent, rot, decode_step=True)
        handle = idx.wk.register_forward_hook(lambda module, args, out: out + 1)
        try:
            hooked = idx.keys(latent, rot, decode_step=True)
            want = rot.apply(idx.k_norm(idx.wk(latent)))
        finally:
            handle.remove()
        handle = nn_module.register_module_forward_pre_hook(lambda module, args: (args[0] + 1,))
        try:
            every = idx.keys(latent, rot, decode_step=True)
            want_every = rot.apply(idx.k_norm(idx.wk(latent)))
        finally:
            handle.remove()
    assert torch.equal(hooked, want) and not torch.equal(hooked, plain)
    assert torch.equal(every, want_every) and not torch.equal(every, plain)
    assert torch.equal(idx.keys(latent, rot, decode_step=True), plain)
