"""`decode_ffn`: a decode step's FFN half (one row per request) as four compiled calls, the module path's bits."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model import moe as moe_module
from kvdiet.model.chain_products import ChainForm, chain_fits
from kvdiet.model.decode_ffn import decode_ffn
from kvdiet.model.linear import quantize_fp8_weight
from kvdiet.model.member import overridden, stands_in
from kvdiet.model.transformer import Transformer

TOKENS = [5, 9, 11, 40, 3]


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=5)


def _steps(model: Transformer, batch: int) -> torch.Tensor:
    """Logits of a prefill of 40 tokens (each request its own) then one decode step per token of `TOKENS`."""
    states = [model.new_state() for _ in range(batch)]
    for i, state in enumerate(states):
        model.prefill(state, torch.arange(2, 42) + i)
    return torch.cat([model.decode(states, [t + b for b in range(batch)]) for t in TOKENS])


@contextlib.contextmanager
def _counting_moe_forward() -> Iterator[list[int]]:
    """The calls of `MoE.forward`, one item each, counted by a profile function: a spy set on the class would be a
    class-level patch, which the module path runs (`kvdiet.model.member.overridden`), so every step would enter it."""
    calls: list[int] = []
    code = moe_module.MoE.forward.__code__

    def profile(frame, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is code:
            calls.append(1)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_decode_steps_run_the_four_kernels_with_the_module_paths_bits(micro, monkeypatch, batch) -> None:
    """A decode step of 1..16 requests never enters `MoE.forward`; a forward hook on every MoE (which
    `decode_ffn` leaves to the module path) gives the same logits, bit for bit, through it, and the experts are
    fetched in the same order (an expert cache's reads: routing order for one row, increasing for more)."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    fetched: list[list[int]] = []
    fetch = moe_module.MoE.fetch
    monkeypatch.setattr(
        moe_module.MoE, "fetch", lambda self, ids: fetched.append(list(ids)) or fetch(self, ids)
    )
    with _counting_moe_forward() as calls:
        flat = _steps(micro, batch)
    prefill_calls, flat_fetches = len(calls), list(fetched)
    assert prefill_calls > 0  # the prefills' rows take the module path
    hooks = [block.ffn.register_forward_pre_hook(lambda module, args: None) for block in micro.layers]
    try:
        fetched.clear()
        with _counting_moe_forward() as calls:
            hooked = _steps(micro, batch)
    finally:
        for hook in hooks:
            hook.remove()
    decode_layers = len(TOKENS) * len(micro.layers)
    assert len(calls) == prefill_calls + decode_layers  # each decode layer through the module
    assert torch.equal(flat, hooked)
    assert flat_fetches == fetched
    if batch == 1:
        assert any(ids != sorted(ids) for ids in fetched[-decode_layers:])  # routing order, not increasing


@pytest.mark.parametrize("batch", [1, 16])
def test_the_router_beside_the_shared_experts_products_keeps_one_threads_bits(micro, batch) -> None:
    """At two threads the router runs beside the shared expert's gate and up products (one a thread); at one, in
    turn: the same logits bit for bit, and both the module path's (the hooked steps)."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _steps(micro, batch)
        torch.set_num_threads(1)
        one = _steps(micro, batch)
        hooks = [block.ffn.register_forward_pre_hook(lambda module, args: None) for block in micro.layers]
        try:
            module_path = _steps(micro, batch)
        finally:
            for hook in hooks:
                hook.remove()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, one) and torch.equal(one, module_path)


def test_it_declines_where_the_module_path_must_run(micro, monkeypatch) -> None:
    """17 rows, autograd, fp64, the pure-torch path: None; the module path's bits where it applies (rows of
    random streams), also where the experts' kernel declines (the MoE module computes them then)."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    block = micro.layers[3]
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(4, micro.cfg.hc_mult, micro.cfg.hidden_size, generator=gen)
    pre = torch.rand(4, micro.cfg.hc_mult, generator=gen)
    with torch.no_grad():
        done = decode_ffn(block, h, pre)
        module = block.ffn_half(h, pre)  # decode_step False: the module path
        assert done is not None and torch.equal(done[0], module[0]) and torch.equal(done[1], module[1])
        many = h[:1].expand(17, -1, -1).contiguous()
        assert decode_ffn(block, many, pre[:1].expand(17, -1)) is None
        assert decode_ffn(block, h.double(), pre.double()) is None
    assert decode_ffn(block, h, pre) is None  # autograd on
    with torch.no_grad():
        kernels = native.fp4_kernels()

        class Declining:  # the expert kernel declines (as on a NaN output): the module path runs instead
            def __getattr__(self, name):
                return (lambda *a, **k: None) if name == "expert_groups" else getattr(kernels, name)

        monkeypatch.setattr(native, "fp4_kernels", lambda: Declining())
        declined = decode_ffn(block, h, pre)
        assert declined is not None and torch.equal(declined[0], module[0])
        monkeypatch.undo()
        monkeypatch.setenv(native.ENV, "0")
        assert decode_ffn(block, h, pre) is None  # the pure-torch path: the module path, read once


def test_quantised_experts_decline_before_any_kernel_or_fetch(micro, monkeypatch) -> None:
    """Experts stored FP8 (the released checkpoint's format, every decode step's): `decode_ffn` declines
    before it runs a kernel or fetches an expert, so the module path's ``hc_enter``, ``route_rows`` and
    expert-cache reads are not done twice."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    block = copy.deepcopy(micro.layers[3])
    shared = block.ffn.shared_experts
    for lin in (shared.w1, shared.w2, shared.w3):
        weight, scale = quantize_fp8_weight(lin.weight.data, block=32)
        lin.set_weight(weight, scale, block=32)
    kernels, called = native.fp4_kernels(), []

    class Counting:
        def __getattr__(self, name):
            called.append(name)
            return getattr(kernels, name)

    fetched: list[list[int]] = []
    fetch = block.ffn.fetch
    monkeypatch.setattr(block.ffn, "fetch", lambda ids: fetched.append(ids) or fetch(ids))
    monkeypatch.setattr(native, "fp4_kernels", lambda: Counting())
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, micro.cfg.hc_mult, micro.cfg.hidden_size, generator=gen)
    with torch.no_grad():
        assert decode_ffn(block, h, torch.rand(2, micro.cfg.hc_mult, generator=gen)) is None
    assert not {"hc_enter", "route_rows", "expert_groups", "hc_expand_rows"} & set(called)
    assert fetched == []


def test_a_replaced_or_overridden_moe_takes_the_module_path(micro) -> None:
    """A block whose ``ffn`` is another module (a wrapper), an `MoE` subclass or an MoE whose ``forward`` is
    replaced on the instance: `decode_ffn` declines (no KeyError, no override skipped)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
            return self.inner(x, **kwargs)

    class Scaled(moe_module.MoE):
        def forward(self, x: torch.Tensor, token_ids=None, *, padded: bool = False) -> torch.Tensor:
            return 2 * super().forward(x, token_ids, padded=padded)

    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, micro.cfg.hc_mult, micro.cfg.hidden_size, generator=gen)
    pre = torch.rand(2, micro.cfg.hc_mult, generator=gen)
    for change in ("wrapper", "subclass", "instance", "gate"):
        block = copy.deepcopy(micro.layers[3])
        if change == "wrapper":
            block.ffn = Wrapper(block.ffn)
        elif change == "subclass":
            block.ffn.__class__ = Scaled
        elif change == "instance":
            block.ffn.forward = lambda x, token_ids=None, padded=False: torch.zeros_like(x)
        else:
            block.ffn.gate.forward = lambda x, token_ids=None: (torch.zeros_like(x[:, :1]), x[:, :1].long())
        with torch.no_grad():
            assert decode_ffn(block, h, pre) is None, change
    # the class's own forward replaced (a patch of ``MoE.forward``): the module path runs the new code
    block = copy.deepcopy(micro.layers[3])
    with torch.no_grad():
        assert decode_ffn(block, h, pre) is not None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_module.MoE, "forward", lambda self, x, token_ids=None, padded=False: x)
            assert decode_ffn(block, h, pre) is None
        assert decode_ffn(block, h, pre) is not None  # the own forward back in place


def test_only_a_class_defining_forward_is_marked_as_stood_in_for() -> None:
    class NoForward(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match="NoForward defines no forward"):
        stands_in(NoForward)
    assert overridden(torch.nn.Identity(), torch.nn.Identity)  # not marked: the module path


def _exit_products(model: Transformer, states: list, token: int) -> int:
    """``torch.bmm`` calls of one decode step of ``states`` at the sublayers' exit shape ([B, hc, hc] · [B, hc,
    hidden]), counted by the profiler (it records the ATen calls the compiled layers make too)."""
    cfg = model.cfg
    shape = [[len(states), cfg.hc_mult, cfg.hc_mult], [len(states), cfg.hc_mult, cfg.hidden_size]]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        model.decode(states, [token] * len(states))
    return sum(
        e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key == "aten::bmm" and e.input_shapes == shape
    )


@pytest.mark.parametrize("batch", [1, 3])
def test_the_exit_product_runs_compiled_at_the_threads_it_was_bound_at(micro, batch) -> None:
    """Each sublayer's exit (``combᵀ · residual``) runs as the compiled chain, no ``torch.bmm``, while the intra-op
    threads are those its binding was made at (its form was checked for them); with other threads ``torch.bmm``
    runs again, twice a layer, with the bits of a copy bound at those threads (which runs the chain again)."""
    cfg, threads = micro.cfg, torch.get_num_threads()

    def form() -> ChainForm:  # checked once per thread count (its own torch.bmm calls), before the counts
        return chain_fits(cfg.hc_mult, cfg.hc_mult, cfg.hidden_size, True, False, single=batch == 1)

    if form() is ChainForm.NONE:
        pytest.skip(
            "torch.bmm on this CPU sums the exit's shape in an order the compiled chain does not take"
        )
    model = copy.deepcopy(micro)
    states = [model.new_state() for _ in range(batch)]
    for i, state in enumerate(states):
        model.prefill(state, torch.arange(2, 42) + i)
    assert _exit_products(model, states, 7) == 0  # bound at `threads` by its first step
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        if form() is ChainForm.NONE:
            pytest.skip("the compiled chain does not take the exit's shape at the other thread count")
        rebound, rebound_states = copy.deepcopy(model), copy.deepcopy(states)  # a copy drops its bindings
        assert _exit_products(model, states, 8) == 2 * len(model.layers)
        assert _exit_products(rebound, rebound_states, 8) == 0
        assert torch.equal(model.decode(states, [9] * batch), rebound.decode(rebound_states, [9] * batch))
    finally:
        torch.set_num_threads(threads)


def test_per_backend_matmul_precisions_keep_prefill_and_decode_on_torchs_products(micro) -> None:
    """With a per-backend fp32 precision set (``torch.backends.cuda.matmul.fp32_precision``), torch's one-precision
    getter raises; prefill and decode then run torch's own products (no compiled chain: `chain_fits` gives
    `ChainForm.NONE`, the bound exits ``torch.bmm``) with the same logits as before it was set."""
    model = copy.deepcopy(micro)
    states = [model.new_state() for _ in range(2)]
    for state in states:
        model.prefill(state, torch.arange(2, 30))
    model.decode([states[0]], [5])  # bound at the one precision torch names
    want = copy.deepcopy(model).decode([copy.deepcopy(states[0])], [6])
    cfg, old = micro.cfg, torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert chain_fits(cfg.hc_mult, cfg.hc_mult, cfg.hidden_size, True, False) is ChainForm.NONE
        assert torch.equal(model.decode([states[0]], [6]), want)
        fresh = model.new_state()
        model.prefill(fresh, torch.arange(2, 30))
        assert torch.equal(model.decode([fresh], [5]), model.decode([states[1]], [5]))
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
