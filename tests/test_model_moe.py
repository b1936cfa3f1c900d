"""The V4.1 MoE FFN (v41-spec §8.2a)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.expert_buffers import run_sorted_groups
from kvdiet.model.fused_rows import expert_groups
from kvdiet.model.moe import Expert, MoE, run_experts


@pytest.fixture(scope="module")
def micro():
    return load_config("v4.1-micro")  # hidden 64, 4 experts top-2, inter 32, swiglu_limit 10


def _expert_ref(expert, x, weight, limit):
    gate = expert.w1.weight @ x
    up = expert.w3.weight @ x
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return expert.w2.weight @ (weight * F.silu(gate) * up)


def _moe_ref(moe, cfg, x):
    """One token at a time: scores, sorted choice with lowest-index ties, weights, experts, shared."""
    out = []
    for t in range(x.shape[0]):
        xt = x[t]
        scores = [math.sqrt(F.softplus(moe.gate.weight[e] @ xt).item()) for e in range(cfg.n_routed_experts)]
        biased = [s + moe.gate.bias[e].item() for e, s in enumerate(scores)]
        chosen = sorted(range(cfg.n_routed_experts), key=lambda e: (-biased[e], e))[: cfg.num_experts_per_tok]
        w = [scores[e] for e in chosen]
        if cfg.norm_topk_prob and len(w) > 1:
            total = sum(w)
            w = [v / (total + 1e-20) for v in w]
        y = _expert_ref(moe.shared_experts, xt, 1.0, cfg.swiglu_limit)
        for e, we in zip(chosen, w, strict=True):
            y = y + _expert_ref(moe.experts[e], xt, we * cfg.routed_scaling_factor, cfg.swiglu_limit)
        out.append(y)
    return torch.stack(out)


def test_state_dict_names(micro):
    torch.manual_seed(0)
    names = set(MoE(micro).state_dict())
    expected = {"gate.weight", "gate.bias"}
    for prefix in [f"experts.{e}." for e in range(4)] + ["shared_experts."]:
        expected |= {prefix + w + ".weight" for w in ("w1", "w2", "w3")}
    assert names == expected
    moe = MoE(micro)
    assert moe.gate.weight.shape == (4, 64) and moe.gate.bias.shape == (4,)
    assert moe.experts[0].w1.weight.shape == (32, 64) and moe.experts[0].w2.weight.shape == (64, 32)
    assert moe.shared_experts.w3.weight.shape == (32, 64)
    assert moe.gate.bias.abs().sum() == 0


def test_matches_per_token_reference(micro):
    torch.manual_seed(0)
    moe = MoE(micro)
    with torch.no_grad():
        moe.gate.weight.normal_(std=0.5)
        moe.gate.bias.copy_(torch.tensor([0.1, -0.2, 0.05, 0.0]))
    x = torch.randn(33, 64)
    with torch.no_grad():
        out = moe(x)
        ref = _moe_ref(moe, micro, x)
    assert out.shape == (33, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_bias_changes_selection_not_weights(micro):
    torch.manual_seed(1)
    moe = MoE(micro)
    x = torch.randn(16, 64)
    with torch.no_grad():
        moe.gate.weight.normal_(std=0.5)
        scores = torch.sqrt(F.softplus(x @ moe.gate.weight.T))
        moe.gate.bias.copy_(torch.tensor([0.0, 0.0, 100.0, 100.0]))  # force experts 2 and 3
        weights, ids = moe.gate(x)
    assert ids.sort(dim=1).values.tolist() == [[2, 3]] * 16
    raw = scores.gather(1, ids)
    torch.testing.assert_close(weights, raw / raw.sum(1, keepdim=True) * 1.5, rtol=1e-6, atol=0)
    unbiased = scores.topk(2, dim=1).indices.sort(dim=1).values
    assert unbiased.tolist() != [[2, 3]] * 16  # the bias did change the selection


def test_swiglu_clamp_is_active(micro):
    torch.manual_seed(2)
    moe = MoE(micro)
    with torch.no_grad():
        for expert in [*moe.experts, moe.shared_experts]:
            expert.w1.weight.normal_(std=1.0)
            expert.w3.weight.normal_(std=1.0)
    x = torch.randn(8, 64) * 3
    with torch.no_grad():
        shared = moe.shared_experts
        assert (shared.w3.weight @ x.T).abs().max() > 10 and (shared.w1.weight @ x.T).max() > 10
        out = moe(x)
        torch.testing.assert_close(out, _moe_ref(moe, micro, x), rtol=1e-5, atol=1e-4)
        unclamped = _moe_ref(moe, micro.replace(swiglu_limit=0.0), x)
    assert (out - unclamped).abs().max() > 1.0


def test_ties_pick_lowest_index(micro):
    torch.manual_seed(3)
    moe = MoE(micro)
    x = torch.randn(10, 64)
    with torch.no_grad():
        moe.gate.weight.zero_()  # every score is sqrt(softplus(0)): a four-way tie
        _, ids = moe.gate(x)
        assert ids.tolist() == [[0, 1]] * 10
        moe.gate.bias.copy_(torch.tensor([0.0, 0.5, 0.5, 0.5]))
        _, ids = moe.gate(x)
        assert ids.tolist() == [[1, 2]] * 10
        weights, _ = moe.gate(x)
    torch.testing.assert_close(weights, torch.full((10, 2), 0.75), rtol=1e-6, atol=0)


def test_single_expert_weight_is_not_normalised(micro):
    cfg = micro.replace(num_experts_per_tok=1)
    torch.manual_seed(4)
    moe = MoE(cfg)
    x = torch.randn(5, 64)
    with torch.no_grad():
        weights, _ = moe.gate(x)
        scores = torch.sqrt(F.softplus(x @ moe.gate.weight.T))
        torch.testing.assert_close(weights[:, 0], scores.max(1).values * 1.5, rtol=1e-6, atol=0)
        torch.testing.assert_close(moe(x), _moe_ref(moe, cfg, x), rtol=1e-5, atol=1e-6)


def test_thousands_of_tokens_are_fast():
    cfg = load_config("v4.1-mini")  # hidden 256, 8 experts top-2, inter 128
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(4096, 256)
    with torch.no_grad():
        moe(x[:8])
        start = time.perf_counter()
        out = moe(x)
        elapsed = time.perf_counter() - start
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:4], _moe_ref(moe, cfg, x[:4]), rtol=1e-4, atol=1e-6)
    assert elapsed < 5.0  # about 0.05 s on 2 idle cores; a per-token loop takes seconds


def test_rejects_other_scoring(micro):
    with pytest.raises(ValueError, match="scoring_func"):
        MoE(micro.replace(scoring_func="softmax"))


def _per_expert(moe, x, weights, ids):
    """The FFN with one `Expert` call per (row, slot) and the shared expert on its own: every product a
    `Linear`'s (a decode row's products are each row's own, so this is `MoE`'s sum to the bit)."""
    out = []
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        slots = [moe.experts[e](row, weights[t : t + 1, j : j + 1]) for j, e in enumerate(ids[t].tolist())]
        out.append(torch.cat(slots).view(1, len(slots), -1).sum(1) + moe.shared_experts(row))
    return torch.cat(out)


def test_one_row_path_equals_the_grouped_path_bit_for_bit(micro):
    """A decode step of one request skips the grouping: every expert's group is that one row, so the sums
    are the same to the bit, and the same as one `Expert` call per slot."""
    torch.manual_seed(4)
    moe = MoE(micro)
    x = torch.randn(40, micro.hidden_size)
    with torch.no_grad():
        for t in range(x.shape[0]):
            row = x[t : t + 1]
            weights, ids = moe.gate(row)
            assert len(set(ids[0].tolist())) == micro.num_experts_per_tok
            one = moe._one_row(row, weights, ids)
            assert torch.equal(one, moe._routed_grouped(row, weights, ids))
            assert torch.equal(moe(row), one)
            assert torch.equal(one, _per_expert(moe, row, weights, ids))


@pytest.mark.parametrize("compiled", [True, False], ids=["expert_rows", "torch"])
def test_run_experts_gives_each_experts_bits_in_one_or_two_calls(micro, monkeypatch, compiled):
    """Dense experts on a few rows: one compiled `expert_rows` call for all of them (or, on the pure-torch path,
    two `row_products_each` calls), each output the expert's own forward to the bit, clamp and NaN included;
    an FP8-stored expert (or too many rows) sends every expert through its own forward."""
    if not compiled:
        monkeypatch.setenv(native.ENV, "0")
    elif native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    torch.manual_seed(8)
    layer = MoE(micro)
    experts = [layer.experts[2], layer.experts[0], layer.experts[3], layer.shared_experts]
    experts[2].swiglu_limit = 0.0  # no clamp for this one
    xs = [torch.randn(n, micro.hidden_size) * 40 for n in (3, 1, 5, 16)]  # past the clamp of 10
    xs[0][1, 3] = float("nan")
    xs[2][0, :] = 0.0
    weights = [torch.rand(3, 1), torch.rand(1, 1), torch.rand(10, 1)[::2, :], None]  # a strided weight too
    calls: list[tuple[str, int]] = []
    linears: list[int] = []  # Linear calls (an expert's own forward)
    each = gemv.row_products_each
    monkeypatch.setattr(
        gemv, "row_products_each", lambda a, b, **kw: calls.append(("each", len(a))) or each(a, b, **kw)
    )
    kernels = native.fp4_kernels()
    if kernels is not None:

        class Counted:
            def __getattr__(self, name):
                return getattr(kernels, name)

            def expert_rows(self, xs, *args):
                calls.append(("expert_rows", len(xs)))
                return kernels.expert_rows(xs, *args)

        monkeypatch.setattr(native, "fp4_kernels", lambda: Counted())
    for e in experts:
        for lin in (e.w1, e.w2, e.w3):
            lin.register_forward_hook(lambda *_: linears.append(1))
    with torch.no_grad():
        got = run_experts(experts, xs, weights)
        assert calls == ([("expert_rows", 4)] if compiled else [("each", 8), ("each", 4)]) and linears == []
        for e, x, w, out in zip(experts, xs, weights, got, strict=True):
            want = e(x, w)
            assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(out.isnan(), want.isnan())
        assert got[0][1].isnan().all() and not got[0][0].isnan().any()  # the NaN row stays NaN, alone
        big = [xs[0], xs[1], torch.randn(gemv.ROWS_MAX + 1, micro.hidden_size), xs[3]]
        w3 = layer.experts[0].w3.weight
        fp8 = MoE(micro).experts[0]
        fp8.load_state_dict(layer.experts[0].state_dict())
        fp8.w3.set_weight(w3.to(torch.float8_e4m3fn), torch.ones(1, 1), block=128)
        weights[2] = torch.rand(gemv.ROWS_MAX + 1, 1)
        for case_experts, case_xs in ((experts, big), ([experts[0], fp8, *experts[2:]], xs)):
            calls.clear()
            linears.clear()
            case_weights = weights if case_xs is big else [*weights[:2], torch.rand(5, 1), None]
            got = run_experts(case_experts, case_xs, case_weights)
            assert calls == [] and len(linears) >= 6  # every expert through its own Linears
            for o, e, x, w in zip(got, case_experts, case_xs, case_weights, strict=True):
                assert torch.equal(o.nan_to_num(7.0), e(x, w).nan_to_num(7.0))


@pytest.mark.parametrize("compiled", [True, False], ids=["expert_rows", "torch"])
def test_run_experts_keeps_the_gradient_of_routing_weights(micro, monkeypatch, compiled):
    """Routing weights that require grad (a MoE run outside ``no_grad``: the gate's weight is a parameter) get the
    gradient each expert's own forward gives them; the decode-row products keep no autograd graph."""
    if not compiled:
        monkeypatch.setenv(native.ENV, "0")
    torch.manual_seed(3)
    layer = MoE(micro)
    experts = [layer.experts[1], layer.experts[3], layer.shared_experts]
    xs = [torch.randn(n, micro.hidden_size) for n in (2, 1, 3)]
    weights = [torch.rand(2, 1, requires_grad=True), torch.rand(1, 1, requires_grad=True), None]
    got = run_experts(experts, xs, weights)
    assert all(out.requires_grad for out in got[:2])
    torch.stack([out.sum() for out in got[:2]]).sum().backward()
    grads = [w.grad.clone() for w in weights[:2]]
    for w in weights[:2]:
        w.grad = None
    want = [e(x, w) for e, x, w in zip(experts, xs, weights, strict=True)]
    torch.stack([out.sum() for out in want[:2]]).sum().backward()
    for g, w, out, ref in zip(grads, weights, got, want, strict=False):
        assert torch.equal(g, w.grad) and torch.equal(out.detach(), ref.detach())


def test_a_row_naming_one_expert_twice_is_grouped(micro):
    """Hash routing may name an expert twice for a token: that expert then runs on a group of two rows."""
    torch.manual_seed(5)
    moe = MoE(micro, hash_routed=True)
    moe.gate.tid2eid[7] = torch.tensor([2, 2])
    row = torch.randn(1, micro.hidden_size)
    with torch.no_grad():
        weights, ids = moe.gate(row, torch.tensor([7]))
        want = moe._routed_grouped(row, weights, ids)
        assert torch.equal(moe(row, torch.tensor([7])), want)
        torch.testing.assert_close(moe(row, torch.tensor([7])), _moe_ref_hash(moe, micro, row[0], [2, 2]))


def _moe_ref_hash(moe, cfg, xt, chosen):
    scores = [math.sqrt(F.softplus(moe.gate.weight[e] @ xt).item()) for e in chosen]
    total = sum(scores)
    y = _expert_ref(moe.shared_experts, xt, 1.0, cfg.swiglu_limit)
    for e, s in zip(chosen, scores, strict=True):
        y = y + _expert_ref(
            moe.experts[e], xt, s / (total + 1e-20) * cfg.routed_scaling_factor, cfg.swiglu_limit
        )
    return y[None]


def test_a_batched_decode_step_gives_each_rows_bits_on_the_cpu(micro):
    """A batched decode step's rows (a few per expert) on the CPU: the experts' products are decode rows
    (`run_experts`), so each row's FFN is the per-slot `Expert` calls' to the bit, with or without ``padded``."""
    torch.manual_seed(6)
    moe = MoE(micro)
    x = torch.randn(16, micro.hidden_size)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        want = _per_expert(moe, x, weights, ids)
        assert torch.equal(moe(x, padded=True), want)
        assert torch.equal(moe(x), want)


def test_a_few_rows_per_expert_run_as_one_padded_batch(micro):
    """More rows than a decode step's products take (here 24) with ``padded``: no routed `Expert` runs, one
    padded batched matmul per weight, and the sum is the per-token reference's; without ``padded`` (a
    prefill), or with FP8-stored experts, every expert's group runs on its own."""
    torch.manual_seed(6)
    moe = MoE(micro)
    calls: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: calls.append(e))
    x = torch.randn(24, micro.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x, padded=True), _moe_ref(moe, micro, x), rtol=1e-5, atol=1e-6)
        assert calls == []
        moe(x)
        assert sorted(set(calls)) == [0, 1, 2, 3]
        calls.clear()
        w = moe.experts[1].w3.weight
        moe.experts[1].w3.set_weight(w.to(torch.float8_e4m3fn), torch.ones(1, 1), block=128)
        moe(x, padded=True)
    assert sorted(set(calls)) == [0, 1, 2, 3]


def _router_inputs(rows: int, experts: int, seed: int):
    """Router inputs with every hard case: equal scores (identical weight rows), a bias that ties them again, NaN
    rows and columns, ±inf, −0.0, subnormal and huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=g).float()
    weight = torch.randn(experts, 64, generator=g)
    weight[1] = weight[0]  # experts 0 and 1 always score the same
    weight[experts - 1] = 0.0  # softplus(0) for every row: ties with the bias below
    bias = torch.zeros(experts)
    bias[2] = math.log(2.0) ** 0.5 - 0.5  # nudges expert 2 near expert E−1's sqrt(log 2)
    specials = [math.nan, math.inf, -math.inf, -0.0, 1e-40, 3e38]
    for i in range(min(rows, len(specials))):
        x[i, i] = specials[i]  # a NaN row, ±inf rows (inf · 0 = NaN for expert E−1), ...
    if rows > 1:
        weight[3, 5] = math.nan  # a NaN expert for every row
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("topk", [1, 2, 3, 8])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_kernel_gives_the_torch_ops_bits(rows, topk, normalize, monkeypatch):
    from kvdiet.model.moe import Gate

    kernels = native.fp4_kernels()
    assert kernels is not None, "the compiled kernels did not build"
    gate = Gate(64, 8, topk, norm_topk_prob=normalize, routed_scaling_factor=1.5)
    x, weight, bias = _router_inputs(rows, 8, 100 * rows + topk)
    with torch.no_grad():
        gate.weight.copy_(weight)
        gate.bias.copy_(bias)
        direct = kernels.route_rows(x, gate.weight, gate.bias, topk, normalize, 1.5)
        got = gate(x)
        monkeypatch.setenv(native.ENV, "0")  # the torch ops
        want = gate(x)
    assert direct is not None
    for g in (got, direct):
        assert torch.equal(g[1], want[1]) and g[1].dtype == torch.int64
        assert g[0].dtype == torch.float32 and torch.equal(g[0].view(torch.int32), want[0].view(torch.int32))
    assert want[0].isnan().any()  # the NaN cases are reached


def test_router_kernel_takes_torchs_square_root(monkeypatch):
    # torch's CPU sqrt is not always correctly rounded (with MKL it runs VML's): some scores of these ordinary
    # rows round the other way from std::sqrt (the kernel before this test used it and failed here)
    from kvdiet.model.moe import Gate

    gen = torch.Generator().manual_seed(0)
    gate = Gate(64, 8, 2, norm_topk_prob=True, routed_scaling_factor=1.5)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 64, generator=gen) * 0.125)
        xs = [torch.randn(rows, 64, generator=gen) * 3 for rows in (1, 16) for _ in range(48)]
        got = [gate(x) for x in xs]
        monkeypatch.setenv(native.ENV, "0")  # the torch ops
        want = [gate(x) for x in xs]
    for (w, i), (w0, i0) in zip(got, want, strict=True):
        assert torch.equal(i, i0) and torch.equal(w.view(torch.int32), w0.view(torch.int32))


def test_router_kernel_declines_what_it_does_not_fit(micro):
    from kvdiet.model.moe import Gate

    kernels = native.fp4_kernels()
    x, w, b = torch.randn(3, 64), torch.randn(8, 64), torch.randn(8)
    assert kernels.route_rows(x, w, b, 2, True, 1.5) is not None
    assert kernels.route_rows(torch.randn(17, 64), w, b, 2, True, 1.5) is None
    assert kernels.route_rows(x.double(), w.double(), b.double(), 2, True, 1.5) is None
    assert kernels.route_rows(x, w, b, 0, True, 1.5) is None
    assert kernels.route_rows(x, w, b, 9, True, 1.5) is None
    assert kernels.route_rows(x, w, b[:7], 2, True, 1.5) is None
    assert kernels.route_rows(torch._neg_view(x), w, b, 2, True, 1.5) is None
    gate = Gate(64, 8, 2, norm_topk_prob=True, routed_scaling_factor=1.5)
    weights, _ = gate(x)  # autograd on: the torch ops, which keep the graph
    assert weights.grad_fn is not None


def test_the_routers_region_check_follows_torchs_thread_count():
    """`route_scores_agree` (whether the router may run inside a parallel region, where MKL takes one thread) finds
    the bits the same at one thread, where inside and outside run alike; and where torch's own product of a shape
    takes other bits at one thread than at two (v4.1-micro's two-row router on an AMD EPYC), not the same at two."""
    kernels = native.fp4_kernels()
    shapes = [(1, 64, 4), (2, 64, 4), (2, 64, 6), (4, 64, 16), (4, 256, 8)]
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        torch.set_num_threads(1)
        assert all(kernels.route_scores_agree(*shape) for shape in shapes)
        for rows, hidden, experts in shapes:
            x, w = torch.randn(rows, hidden, generator=gen), torch.randn(experts, hidden, generator=gen)
            torch.set_num_threads(1)
            one = x @ w.T
            torch.set_num_threads(2)
            if not torch.equal(one, x @ w.T):
                assert not kernels.route_scores_agree(rows, hidden, experts)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="must be >= 1"):
        kernels.route_scores_agree(0, 64, 4)


@pytest.mark.parametrize("topk", [1, 2, 3, 6, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("hidden", [64, 80])
def test_grouped_kernel_gives_the_torch_ops_bits(micro, topk, rows, hidden, monkeypatch):
    """Decode rows of one or many requests through ``expert_groups`` = `run_experts` on the Python groups and
    torch's slot sum, bit for bit; expert outputs of very different sizes make the slot order show. Hidden 80:
    torch sums the last 16 columns of more than 4 slots in interleaved partial sums, not one at a time."""
    import kvdiet.model.moe as moe_module

    cfg = micro.replace(n_routed_experts=8, num_experts_per_tok=topk, hidden_size=hidden)
    torch.manual_seed(10 + topk + rows)
    moe = MoE(cfg)
    calls = []
    kernel = moe_module.expert_groups
    monkeypatch.setattr(moe_module, "expert_groups", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            expert.w2.weight.mul_(10.0 ** (3 * (e % 4) - 4))
        for seed in range(3):
            x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * 3
            got = moe(x, padded=True)
            with monkeypatch.context() as m:
                m.setattr(moe_module, "expert_groups", lambda *a: None)  # run_experts and torch's sum
                want = moe(x, padded=True)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        # a row naming one expert twice, and an expert taking every row
        ids = torch.zeros(rows, topk, dtype=torch.int64)
        ids[:, 1:] = torch.arange(1, topk) if topk > 1 else ids[:, 1:]
        ids[0, -1] = 0
        weights = torch.rand(rows, topk, generator=torch.Generator().manual_seed(9))
        got = moe._routed_grouped(x, weights, ids)
        with monkeypatch.context() as m:
            m.setattr(moe_module, "expert_groups", lambda *a: None)
            want = moe._routed_grouped(x, weights, ids)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # every call went to the kernel, but a group of more than 16 pairs (expert 0 of 16 rows naming it twice)
    assert len(calls) == 3 + int(torch.bincount(ids.flatten()).max() <= 16)
    ids, weights = ids[:8], weights[:8]  # at most 16 pairs per expert
    used = sorted(set(ids.flatten().tolist()))
    args = (used, [moe.experts[e] for e in used], moe.shared_experts)
    x = x[: len(ids)]
    assert kernel(x, weights, ids, *args) is None  # autograd on
    with torch.no_grad():
        assert kernel(x, weights.double(), ids, *args) is None
        assert kernel(x.double(), weights, ids, *args) is None
        assert kernel(x, weights, ids, *args) is not None


_LIMIT = 10.0
_ULP_UP, _ULP_DOWN = math.nextafter(_LIMIT, math.inf), math.nextafter(_LIMIT, -math.inf)
# values the activation must pass through unchanged: either side of the clamp, ±0, subnormals, huge (past the
# clamp; 6e38, halved into a row, doubles to inf in the products)
_SPECIALS = [_LIMIT, _ULP_UP, _ULP_DOWN, -_LIMIT, -_ULP_UP, -_ULP_DOWN, 0.0, -0.0, 1e-40, -1e-45, 1e30, -1e30]
_SPECIALS.append(6e38)


def _picking_expert(hidden: int, inter: int, limit: float, seed: int) -> Expert:
    """An `Expert` whose gate and up are twice the row's own entries: w1[j, j % hidden] = w3[j, (j + 1) % hidden]
    = 2, zeros elsewhere (one product plus zeros: exact), so the activation sees chosen values; w2 random."""
    expert = Expert(hidden, inter, swiglu_limit=limit)
    cols = torch.arange(inter)
    with torch.no_grad():
        for lin, shift in ((expert.w1, 0), (expert.w3, 1)):
            lin.weight.zero_()
            lin.weight[cols, (cols + shift) % hidden] = 2.0
        expert.w2.weight.copy_(torch.randn(hidden, inter, generator=torch.Generator().manual_seed(seed)))
    return expert


def _adversarial_rows(rows: int, hidden: int, seed: int, *, infinite: bool = True) -> torch.Tensor:
    """Rows whose doubled values (the gates of `_picking_expert`) all have a silu that differs between torch's
    scalar loop (std::exp; a strided input runs it) and its vector loop, each row with `_SPECIALS` halved at a
    place of its own."""
    draws = torch.rand(64 * rows * hidden, generator=torch.Generator().manual_seed(seed)) * 24 - 12
    scalar = F.silu(torch.stack([draws, draws], 1)[:, 0])
    splitting = draws[F.silu(draws) != scalar]  # a few percent of the draws
    assert splitting.numel() >= rows * hidden
    x = splitting[: rows * hidden].view(rows, hidden) / 2
    specials = _SPECIALS if infinite else _SPECIALS[:-1]  # without 6e38: no inf
    for r in range(rows):
        for i, v in enumerate(specials):
            x[r, (r * 5 + i * 3) % hidden] = v / 2
    return x


# (routed inters, shared inter, limits of the routed experts then the shared, rows per routed expert, shared rows):
# the first and last meet expert_rows' condition for one op per activation step over all experts; the others miss
# it by one clause each: inter not a multiple of 32 (48; 40 also pads w2's input), two clamp limits, weighted
# experts of two inters, GRAIN_SIZE (32768) elements or more
_ACTIVATION_CASES = {
    "together": ([64, 64, 64], 128, [_LIMIT] * 4, [3, 1, 5], 16),
    "inter-48": ([48, 48, 48], 48, [_LIMIT] * 4, [3, 1, 5], 16),
    "inter-40": ([40, 40, 40], 40, [_LIMIT] * 4, [3, 1, 5], 16),
    "two-limits": ([64, 64, 64], 64, [_LIMIT, _LIMIT, 0.0, _LIMIT], [3, 1, 5], 16),
    "two-inters": ([64, 96, 64], 64, [_LIMIT] * 4, [3, 1, 5], 16),
    "grain": ([1024, 1024], 1024, [_LIMIT] * 3, [16, 16], 16),
    "no-clamp": ([32, 32], 32, [0.0] * 3, [3, 7], 5),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(_ACTIVATION_CASES))
def test_expert_rows_activation_gives_each_experts_bits(case, threads):
    """``expert_rows`` (one torch op per activation step over all experts where its condition holds, else one per
    expert) = each expert's own forward to the bit, on values either side of the clamp, ±0, subnormals, ±inf
    (NaN where silu(−inf) makes one), and values whose silu differs between torch's scalar and vector loops; routing
    weights ±0, subnormal and huge. Where the inter is not a multiple of 32, the inputs are such that one op over
    every expert's rows would give other bits."""
    kernels = native.fp4_kernels()
    if kernels is None:
        pytest.fail("the compiled kernels did not build")
    inters, shared_inter, limits, rows, shared_rows = _ACTIVATION_CASES[case]
    hidden = 64
    shapes = zip([*inters, shared_inter], limits, strict=True)
    experts = [_picking_expert(hidden, n, lim, s) for s, (n, lim) in enumerate(shapes)]
    xs = [_adversarial_rows(m, hidden, 20 + s) for s, m in enumerate([*rows, shared_rows])]
    xs[0][0, 0] = -3e38  # doubled: gate −inf, silu NaN
    weights = [torch.rand(m, 1, generator=torch.Generator().manual_seed(40 + s)) for s, m in enumerate(rows)]
    weights[0][:3, 0] = torch.tensor([-0.0, 1e-40, 3e30])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = kernels.expert_rows(
                xs,
                *([getattr(e, w).weight for e in experts] for w in ("w1", "w3", "w2")),
                [*weights, None],
                limits,
            )
            for e, x, w, out in zip(experts, xs, [*weights, None], got, strict=True):
                want = e(x, w)
                assert torch.equal(out.isnan(), want.isnan())
                assert torch.equal(
                    out.nan_to_num(7.0).view(torch.int32), want.nan_to_num(7.0).view(torch.int32)
                )
            assert got[0][0].isnan().all() and not got[0][1:].isnan().any()
            if inters[0] % 32:  # one op over every expert's gate would put other values in the scalar tail
                gates = [e.w1(x).clamp(max=lim) for e, x, lim in zip(experts, xs, limits, strict=True)]
                each = torch.cat([F.silu(g).flatten() for g in gates]).view(torch.int32)
                assert not torch.equal(
                    F.silu(torch.cat([g.flatten() for g in gates])).view(torch.int32), each
                )
    finally:
        torch.set_num_threads(old)


def _grouped_ref(x, weights, ids, experts, shared):
    """`MoE._routed_grouped` with each group through its `Expert`'s own forward: the (row, slot) pairs grouped by
    expert (stable), each group's rows and weights [n, 1], back in (row, slot) order, summed over the slots, plus
    the shared expert."""
    rows, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    outs = torch.empty(rows * k, x.shape[1])
    for e in sorted(set(flat.tolist())):
        pairs = order[flat[order] == e]
        outs[pairs] = experts[e](x[pairs // k], weights.flatten()[pairs][:, None])
    return outs.view(rows, k, -1).sum(1) + shared(x)


@pytest.mark.parametrize("inter", [64, 48])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_expert_groups_gives_the_per_expert_forwards_bits(inter, rows):
    """``expert_groups`` on adversarial rows (see `_adversarial_rows`; no inf, so no NaN) = `_grouped_ref` to the
    bit, with one activation op per step over every expert (inter 64) and one per expert (48); with an inf
    (NaN outputs) it declines."""
    hidden, k = 64, 3
    experts = {e: _picking_expert(hidden, inter, _LIMIT, e) for e in range(6)}
    shared = _picking_expert(hidden, 2 * inter, _LIMIT, 9)
    ids = torch.stack(
        [torch.randperm(6, generator=torch.Generator().manual_seed(r))[:k] for r in range(rows)]
    )
    weights = torch.rand(rows, k, generator=torch.Generator().manual_seed(3))
    weights[0] = torch.tensor([-0.0, 1e-40, 3e3])
    used = sorted(set(ids.flatten().tolist()))
    with torch.no_grad():
        x = _adversarial_rows(rows, hidden, 7, infinite=False)
        got = expert_groups(x, weights, ids, used, [experts[e] for e in used], shared)
        want = _grouped_ref(x, weights, ids, experts, shared)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
        x[0, 1] = -3e38  # doubled: gate −inf, silu NaN
        assert expert_groups(x, weights, ids, used, [experts[e] for e in used], shared) is None


@pytest.mark.parametrize("rows", [17, 200])
def test_a_prefills_groups_give_each_experts_forward_bits(micro, rows, monkeypatch):
    """A prefill's rows (more than ``gemv.ROWS_MAX``: its groups through `run_sorted_groups`, then back in (row,
    slot) order by the inverse of the sort) = `_grouped_ref` to the bit, on adversarial rows, with groups either
    side of ROWS_MAX and a row naming one expert twice."""
    torch.manual_seed(0)
    moe = MoE(micro)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(rows)])
    ids[: rows // 2, 0] = 2  # expert 2's group the largest
    ids[-1] = torch.tensor([1, 1])
    weights = torch.rand(rows, 2, generator=gen)
    ran = []
    monkeypatch.setattr(
        "kvdiet.model.moe.run_sorted_groups", lambda *a: ran.append(run_sorted_groups(*a)) or ran[-1]
    )
    with torch.no_grad():
        x = _adversarial_rows(rows, 64, 3, infinite=False)
        got = moe._routed_grouped(x, weights, ids)
        want = _grouped_ref(x, weights, ids, moe.experts, moe.shared_experts)
    assert len(ran) == 1 and ran[0] is not None
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_expert_groups_declines_weights_it_cannot_read_in_place():
    """A used expert's weight that is not contiguous fp32, or a lazily negated view (its storage holds −w): None,
    nothing raised (the kernel checks, not Python). Negated routing weights are read as their values; negated
    rows are declined (`gemv.applies_all`)."""
    hidden, inter, k, rows = 64, 64, 2, 4
    experts = {e: _picking_expert(hidden, inter, _LIMIT, e) for e in range(4)}
    shared = _picking_expert(hidden, inter, _LIMIT, 9)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    weights = torch.rand(rows, k, generator=torch.Generator().manual_seed(1))
    used = [0, 1, 2, 3]
    with torch.no_grad():
        x = _adversarial_rows(rows, hidden, 5, infinite=False)
        want = expert_groups(x, weights, ids, used, [experts[e] for e in used], shared)
        assert want is not None
        # lazily negated routing weights are read as their values; negated rows go to the modules
        negated = torch._neg_view(-weights)
        got = expert_groups(x, negated, ids, used, [experts[e] for e in used], shared)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert (
            expert_groups(torch._neg_view(-x), weights, ids, used, [experts[e] for e in used], shared) is None
        )
        w = experts[2].w3.weight
        experts[2].w3.weight = torch.nn.Parameter(w.t().contiguous().t())  # same values, column-major
        assert not experts[2].w3.weight.is_contiguous()
        assert expert_groups(x, weights, ids, used, [experts[e] for e in used], shared) is None
        experts[2].w3.weight = torch.nn.Parameter(w.double())
        assert expert_groups(x, weights, ids, used, [experts[e] for e in used], shared) is None
        experts[2].w3.weight = torch.nn.Parameter(torch._neg_view(-w))  # w's values, stored negated
        assert experts[2].w3.weight.is_neg()
        assert expert_groups(x, weights, ids, used, [experts[e] for e in used], shared) is None
        experts[2].w3.weight = w
        shared.w2.weight = torch.nn.Parameter(shared.w2.weight.t().contiguous().t())
        assert expert_groups(x, weights, ids, used, [experts[e] for e in used], shared) is None


def _sorted_groups_case(inter: int, counts: list[int], seed: int):
    """Experts picking their gates (`_picking_expert`), one per group of ``counts`` rows, the sorted pairs' rows
    ``tokens`` of adversarial ``x`` (`_adversarial_rows`: ±inf too, so NaN outputs) and routing weights [N, 1]
    with ±0, a subnormal, a huge value and an inf."""
    hidden, n = 64, sum(counts)
    experts = [_picking_expert(hidden, inter, _LIMIT, seed + g) for g in range(len(counts))]
    x = _adversarial_rows(97, hidden, seed)
    x[3, 0] = -3e38  # doubled: gate −inf, silu NaN
    tokens = torch.randint(0, x.shape[0], (n,), generator=torch.Generator().manual_seed(seed))
    weights = torch.rand(n, 1, generator=torch.Generator().manual_seed(seed + 1))
    weights[:5, 0] = torch.tensor([-0.0, 1e-40, 3e30, math.inf, 0.0])
    return experts, x, tokens, weights


def _each_group(experts, x, tokens, weights, counts):
    """Each group's rows through its expert's own forward (`Expert.forward`), concatenated in group order."""
    outs, start = [], 0
    for expert, count in zip(experts, counts, strict=True):
        part = slice(start, start + count)
        outs.append(expert(x.index_select(0, tokens[part]), weights[part]))
        start += count
    return torch.cat(outs)


# group sizes either side of gemv.ROWS_MAX (16: the compiled row products below, the BLAS above), odd ones (a
# silu scalar tail per group where inter is not a multiple of 32), and one over GRAIN_SIZE elements (600 × 64)
_GROUP_COUNTS = [1, 16, 17, 3, 33, 100, 5, 600]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter", [64, 48])
def test_sorted_groups_give_each_experts_forward_bits(inter, threads):
    """`run_sorted_groups` = every group through its `Expert`'s forward, to the bit (NaN payloads included), on
    adversarial rows and routing weights (see `_sorted_groups_case`); inter 48 puts a group's silu tail where
    one silu over every group would not (so the silu runs per group: checked below)."""
    experts, x, tokens, weights = _sorted_groups_case(inter, _GROUP_COUNTS, 11)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = run_sorted_groups(x, tokens, weights, _GROUP_COUNTS, experts)
            want = _each_group(experts, x, tokens, weights, _GROUP_COUNTS)
            assert got is not None and got.isnan().any()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
            if inter % 32:
                gates = [e.w1(x[tokens]).clamp(max=_LIMIT).flatten() for e in experts[:2]]
                each = torch.cat([F.silu(g) for g in gates]).view(torch.int32)
                assert not torch.equal(F.silu(torch.cat(gates)).view(torch.int32), each)
    finally:
        torch.set_num_threads(old)


def test_sorted_groups_read_negated_views_and_decline_what_they_do_not_fit():
    """Lazily negated rows, weights and routing weights are read as their values; None (the caller runs each
    expert) under autograd, for a quantised or non-fp32 expert, two clamps, forward hooks, or a group whose rows
    would not start 64-byte aligned (inter 40: 160-byte rows)."""
    counts = [3, 20, 1]
    experts, x, tokens, weights = _sorted_groups_case(64, counts, 5)
    with torch.no_grad():
        want = _each_group(experts, x, tokens, weights, counts)
        got = run_sorted_groups(torch._neg_view(-x), tokens, torch._neg_view(-weights), counts, experts)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
        w = experts[1].w2.weight
        experts[1].w2.weight = torch.nn.Parameter(torch._neg_view(-w))
        got = run_sorted_groups(x, tokens, weights, counts, experts)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
        experts[1].w2.weight = torch.nn.Parameter(w.double())
        assert run_sorted_groups(x, tokens, weights, counts, experts) is None
        experts[1].w2.weight = w
        experts[2].swiglu_limit = 0.0
        assert run_sorted_groups(x, tokens, weights, counts, experts) is None
        experts[2].swiglu_limit = _LIMIT
        hook = experts[1].w3.register_forward_hook(lambda *_: None)
        assert run_sorted_groups(x, tokens, weights, counts, experts) is None
        hook.remove()
        assert run_sorted_groups(x, tokens, weights, counts, experts) is not None
        experts[0].w1.set_weight(experts[0].w1.weight.to(torch.float8_e4m3fn), torch.ones(1, 1), block=128)
        assert run_sorted_groups(x, tokens, weights, counts, experts) is None
        narrow, x40, tokens40, weights40 = _sorted_groups_case(40, counts, 5)
        assert run_sorted_groups(x40, tokens40, weights40, counts, narrow) is None
    assert run_sorted_groups(x, tokens, weights, counts, experts[1:] + experts[1:2]) is None  # autograd on


def test_a_prefill_moe_gives_the_per_expert_forwards_bits(micro):
    """`MoE.forward` on a prefill's rows (groups of more than 16 rows through `run_sorted_groups`) = each group
    through its `Expert`'s forward (`_grouped_ref`), to the bit, on rows with ±0, subnormals and huge values."""
    torch.manual_seed(6)
    moe = MoE(micro)
    x = torch.randn(300, micro.hidden_size) * 3
    x[:4, :3] = torch.tensor([[-0.0, 1e-40, 1e30]])
    with torch.no_grad():
        weights, ids = moe.gate(x)
        assert max(torch.bincount(ids.flatten()).tolist()) > gemv.ROWS_MAX
        got = moe(x)
        want = _grouped_ref(x, weights, ids, moe.experts, moe.shared_experts)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
