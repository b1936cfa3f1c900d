"""The Triton packed-FP4 sparse decode attention against `attend` over decoded entries: in Triton's interpreter
on the CPU (a subprocess: ``TRITON_INTERPRET=1`` must be set before triton compiles anything), compiled on CUDA
when a GPU is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")  # in the dev extra: missing only on a CPU install without it

_CASES = r"""
import json, torch
from kvdiet.formats.fp4 import decode_main_kv, encode_main_kv
from kvdiet.model.attention import attend
from kvdiet.model.triton_decode import Tile, attend_packed, sparse_partials


def case(device, *, b, h, k, splits, seed, band=False, tile=None, spread=False, d=512):
    g = torch.Generator().manual_seed(seed)
    n, w = 97, 9
    # entries of every magnitude: normal and subnormal E4M3 scales, zeros, saturated blocks
    x = torch.randn(n, d, generator=g) * torch.logspace(-4, 3, n)[:, None]
    x[3] = 0.0
    rows = encode_main_kv(x)
    q = torch.randn(b, h, d, generator=g) * 0.05
    if spread:  # heads from 1e-12 to 1e6 in size, one all zeros: the fp16 split's power-of-two scaling
        q = q * torch.logspace(-12, 6, h)[:, None]
        q[:, 1] = 0.0
    slots = torch.randint(0, n, (b, k), generator=g)
    valid = torch.rand(b, k, generator=g) < 0.8
    valid[0] = False  # a query that selects nothing: only the window and the sink
    win_kv = torch.randn(b, w, d, generator=g) if band else torch.randn(w, d, generator=g)  # own or shared
    win_mask = torch.rand(b, w, generator=g) < 0.7
    sink = torch.randn(h, generator=g)
    scale = d**-0.5
    want = attend(q, win_kv, win_mask, decode_main_kv(rows[slots]), valid, sink, scale)
    dev = [t.to(device) for t in (q, win_kv, win_mask, rows, slots, valid, sink)]
    got = attend_packed(*dev[:3], *dev[3:6], dev[6], scale, splits=splits, tile=tile).cpu()
    partials = sparse_partials(dev[0], dev[3], dev[4], dev[5], scale, splits=splits, tile=tile)
    m, l, acc = (t.cpu() for t in partials)
    scores = torch.einsum("bhd,bkd->bhk", q, decode_main_kv(rows[slots])) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    top = scores.amax(-1)[1:]  # each head's largest score (query 0 selects nothing)
    # each head's scale of rounding: its largest Σ|q|·|v| over the selected entries
    size = (torch.einsum("bhd,bkd->bhk", q.abs(), decode_main_kv(rows[slots]).abs()) * scale)[1:]
    size = size.masked_fill(~valid[1:, None, :], 0).amax(-1).clamp(min=1e-30)
    return {
        "err": float((got - want).abs().max() / want.abs().max()),
        "argmax_equal": bool((got.argmax(-1) == want.argmax(-1)).all()),
        "m_err": float(((m.amax(1)[1:] - top).abs() / size).max()),  # per head: its own scale
        "empty_m": m[0].isinf().all().item() and bool((l[0] == 0).all()),
        "splits": m.shape[1],
    }


def exact(device, precision):
    # one entry whose element 0 is 1.0 (E2M1 code 2, E4M3 scale bytes 0x38 = 1.0), the rest 0; each head's
    # query element 0 has 24 significant bits, at 2^0, 2^-100 and 2^100: the score is that element exactly
    # when the split keeps every bit of it (three fp16 terms do, after the power-of-two scaling; two do not)
    rows = torch.zeros(1, 288, dtype=torch.uint8)
    rows[0, 0] = 2
    rows[0, 256:] = 0x38
    assert decode_main_kv(rows)[0, 0] == 1.0 and decode_main_kv(rows)[0, 1:].abs().sum() == 0
    bits = 1 + 2**-12 + 2**-23
    q = torch.zeros(1, 3, 512)
    q[0, :, 0] = torch.tensor([bits, bits * 2**-100, bits * 2**100])
    m, _, _ = sparse_partials(q.to(device), rows.to(device), torch.zeros(1, 1, dtype=torch.int64, device=device),
                              torch.ones(1, 1, dtype=torch.bool, device=device), 1.0, tile=Tile(precision=precision))
    return (m[0, 0].cpu() == q[0, :, 0]).tolist()


def run(device, precision):
    t = Tile(precision=precision)
    k32 = Tile(precision=precision, block_k=32)  # 32 entries a step
    wide = Tile(precision=precision, block_h=32, block_k=32, num_warps=8)
    return {"exact": exact(device, precision), "cases": [
        case(device, b=3, h=4, k=40, splits=1, seed=0, tile=t),
        case(device, b=2, h=5, k=70, splits=3, seed=1, tile=k32),  # heads padded to 16, a partial last block
        case(device, b=2, h=20, k=16, splits=1, seed=2, tile=t),  # two blocks of 16 heads
        case(device, b=3, h=4, k=40, splits=2, seed=3, band=True, tile=t),  # each query its own window
        case(device, b=2, h=40, k=70, splits=2, seed=4, tile=wide),  # 32 heads and 32 entries a step
        case(device, b=2, h=16, k=40, splits=1, seed=5, tile=t, spread=True),
        case(device, b=3, h=4, k=4, splits=1, seed=6, tile=k32, d=64),  # the golden plan: fewer slots than a step
        case(device, b=3, h=4, k=40, splits=2, seed=7, tile=t, d=64),
    ]}
"""


def _check(results: dict, precision: str) -> None:
    # the split keeps all 24 bits of a query element at every magnitude with three terms, not with two
    assert results["exact"] == ([False] * 3 if precision == "fp16x2" else [True] * 3), results["exact"]
    for r in results["cases"]:
        assert r["err"] < 1e-5, r  # fp32 summation order only: decoded values are exact
        assert r["argmax_equal"], r
        assert r["m_err"] < 1e-5, r
        assert r["empty_m"], r  # a query with no valid slot: m = −inf, l = 0 in every split
    assert [r["splits"] for r in results["cases"]] == [1, 3, 1, 2, 2, 1, 1, 2]


@pytest.mark.parametrize("precision", ["fp16x3", "fp16x2", "ieee"])
def test_the_kernel_matches_attend_in_tritons_interpreter(precision: str) -> None:
    code = _CASES + f"\nprint(json.dumps(run('cpu', {precision!r})))"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(json.loads(out.stdout.strip().splitlines()[-1]), precision)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA case: runs on a GPU machine")
@pytest.mark.parametrize("precision", ["fp16x3", "fp16x2", "ieee"])
def test_the_compiled_kernel_matches_attend_on_cuda(precision: str) -> None:
    scope: dict = {}
    exec(compile(_CASES, "triton_cases", "exec"), scope)
    _check(scope["run"]("cuda", precision), precision)


def test_bad_shapes_are_refused_before_the_kernel(monkeypatch) -> None:
    from kvdiet.model.triton_decode import Tile, sparse_partials

    q = torch.zeros(1, 2, 512)
    with pytest.raises(ValueError, match=r"rows must be \[N, 288\]"):
        sparse_partials(q, torch.zeros(4, 280, dtype=torch.uint8), torch.zeros(1, 3), torch.ones(1, 3), 1.0)
    with pytest.raises(ValueError, match="need fp32 q"):
        sparse_partials(
            q.double(), torch.zeros(4, 288, dtype=torch.uint8), torch.zeros(1, 3), torch.ones(1, 3), 1.0
        )
    with pytest.raises(ValueError, match=r"need fp32 q \[B, H, D\] with D ≥ 32"):
        sparse_partials(
            torch.zeros(2, 512),
            torch.zeros(4, 288, dtype=torch.uint8),
            torch.zeros(1, 3),
            torch.ones(1, 3),
            1.0,
        )
    rows, slots, valid = (
        torch.zeros(4, 288, dtype=torch.uint8),
        torch.zeros(1, 3, dtype=torch.int64),
        torch.ones(1, 3),
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="only in Triton's interpreter"):
        sparse_partials(q, rows, slots, valid.bool(), 1.0)
    for tile, message in [
        (Tile(block_h=16.0), "must be ints"),  # type: ignore[arg-type]
        (Tile(num_warps=True), "must be ints"),  # type: ignore[arg-type]
        (Tile(precision="bf16"), "precision must be one of"),
        (Tile(block_k=8), "must be 16, 32 or 64"),
    ]:
        with pytest.raises(ValueError, match=message):
            sparse_partials(q, rows, slots, valid.bool(), 1.0, tile=tile)
