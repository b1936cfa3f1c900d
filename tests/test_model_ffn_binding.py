"""`FfnBinding`: a decode step's FFN half in one compiled ``ffn_rows`` call through weights bound once, with the
pieces' bits, bound again whenever the modules change."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model.decode_ffn import decode_ffn
from kvdiet.model.linear import Linear
from kvdiet.model.transformer import Transformer


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=5)


@pytest.fixture()
def counted(monkeypatch) -> dict[str, int]:
    """Calls of each compiled kernel."""
    kernels = native.fp4_kernels()
    if kernels is None:
        pytest.fail("the compiled kernels did not build")
    calls: dict[str, int] = {}

    class Counting:
        def __getattr__(self, name):
            calls[name] = calls.get(name, 0) + 1
            return getattr(kernels, name)

    monkeypatch.setattr(native, "fp4_kernels", lambda: Counting())
    return calls


def _rows(cfg, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cfg.hc_mult, cfg.hidden_size, generator=gen), torch.rand(
        rows, cfg.hc_mult, generator=gen
    )


def _pieces(block, h, pre):
    """The FFN half through its module path (a hook on the MoE: `decode_ffn` declines, the modules run)."""
    hook = block.ffn.register_forward_pre_hook(lambda module, args: None)
    try:
        return block.ffn_half(h, pre, decode_step=True)
    finally:
        hook.remove()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_one_call_gives_the_module_paths_bits(micro, counted, rows) -> None:
    block = copy.deepcopy(micro.layers[3])
    h, pre = _rows(micro.cfg, rows, seed=rows)
    with torch.no_grad():
        done = decode_ffn(block, h, pre)
        assert counted.get("ffn_rows") == 1 and "expert_groups" not in counted
        want = _pieces(block, h, pre)
    assert done is not None and torch.equal(done[0], want[0]) and torch.equal(done[1], want[1])


def test_decode_steps_through_the_binding_keep_the_logits(micro, counted) -> None:
    """Whole decode steps: every layer's FFN half inside its attention tail's one call (`kvdiet.model.decode_layer`),
    the logits those of the module path (a hooked MoE: the tail leaves the FFN half to the modules)."""
    model = copy.deepcopy(micro)

    def steps() -> torch.Tensor:
        states = [model.new_state() for _ in range(2)]
        for i, state in enumerate(states):
            model.prefill(state, torch.arange(2, 30) + i)
        return torch.cat([model.decode(states, [t, t + 1]) for t in (5, 9, 40)])

    bound = steps()
    assert counted.get("attn_tail") == 3 * len(model.layers) and "ffn_rows" not in counted
    hooks = [block.ffn.register_forward_pre_hook(lambda module, args: None) for block in model.layers]
    try:
        assert torch.equal(bound, steps())
    finally:
        for hook in hooks:
            hook.remove()


def _replace_weight(block) -> None:
    expert = block.ffn.experts[0]
    expert.w1.weight = torch.nn.Parameter(expert.w1.weight * 3, requires_grad=False)


def _replace_linear(block) -> None:
    expert, lin = (
        block.ffn.shared_experts,
        Linear(block.cfg.hidden_size, block.ffn.shared_experts.w3.out_features),
    )
    lin.weight.data.copy_(expert.w3.weight * -2)
    expert.w3 = lin


def _replace_expert(block) -> None:
    block.ffn.experts[1] = copy.deepcopy(block.ffn.experts[0])


def _limit(block) -> None:
    for expert in [*block.ffn.experts, block.ffn.shared_experts]:
        expert.swiglu_limit = 0.01


def _gate(block) -> None:
    block.ffn.gate.routed_scaling_factor = 7.0
    block.ffn.gate.bias = torch.nn.Parameter(torch.randn_like(block.ffn.gate.bias) * 10)


def _norm(block) -> None:
    block.ffn_norm.eps = 0.5


def _hc_in_place(block) -> None:
    # in place, a version counter moves: the kept HcWeights are rebuilt, then the layer bound again
    block.hc_ffn_scale.mul_(1.5)


def _weight_in_place(block) -> None:
    block.ffn.experts[0].w2.weight.data.mul_(-1)  # the kernel reads the tensor itself


@pytest.mark.parametrize(
    "change",
    [_replace_weight, _replace_linear, _replace_expert, _limit, _gate, _norm, _hc_in_place, _weight_in_place],
)
def test_a_changed_module_is_read_again(micro, counted, change) -> None:
    """After the layer is bound, a replaced parameter, submodule or expert, a changed setting, an in-place write:
    the next step's rows are the module path's with the change (never the bound tensors')."""
    block = copy.deepcopy(micro.layers[3])
    h, pre = _rows(micro.cfg, 4, seed=11)
    with torch.no_grad():
        block.hc_ffn_fn.normal_(std=0.1, generator=torch.Generator().manual_seed(1))  # the scales then count
        before = decode_ffn(block, h, pre)
        change(block)
        after = decode_ffn(block, h, pre)
        want = _pieces(block, h, pre)
    assert counted.get("ffn_rows") == 2
    assert after is not None and torch.equal(after[0], want[0]) and torch.equal(after[1], want[1])
    assert not torch.equal(before[0], after[0]) or not torch.equal(before[1], after[1])


def test_an_instances_fetch_or_an_expert_store_takes_the_pieces(micro, counted) -> None:
    """A ``fetch`` set on the MoE instance, or routed experts read on first use (``routed``): the pieces run,
    fetching the experts (an expert cache's reads), with the same bits."""
    block = copy.deepcopy(micro.layers[3])
    h, pre = _rows(micro.cfg, 2, seed=12)
    fetched: list[list[int]] = []
    fetch = block.ffn.fetch
    with torch.no_grad():
        decode_ffn(block, h, pre)  # bound
        block.ffn.fetch = lambda ids: fetched.append(list(ids)) or fetch(ids)
        done = decode_ffn(block, h, pre)
    assert counted.get("ffn_rows") == 1 and counted.get("expert_groups") == 1 and len(fetched) == 1
    del block.ffn.fetch
    with torch.no_grad():
        want = _pieces(block, h, pre)
    assert torch.equal(done[0], want[0])


def test_a_copied_or_pickled_block_binds_its_own_weights(micro, counted) -> None:
    """A bound block deep-copies and pickles (the compiled object does not); the copy binds its own tensors, so
    a write to the copy's weights changes the copy's rows and not the original's."""
    block = copy.deepcopy(micro.layers[3])
    h, pre = _rows(micro.cfg, 1, seed=13)
    with torch.no_grad():
        original = decode_ffn(block, h, pre)
        assert block.ffn_binding is not None and block.ffn_binding.weights is not None
        twin = copy.deepcopy(block)
        assert twin.ffn_binding is None
        assert pickle.loads(pickle.dumps(block)).ffn_binding is None
        twin.ffn.shared_experts.w2.weight.data.mul_(2)
        changed = decode_ffn(twin, h, pre)
        again = decode_ffn(block, h, pre)
    assert torch.equal(original[0], again[0]) and not torch.equal(original[0], changed[0])


@pytest.mark.parametrize("where", ["ffn_norm", "ffn", "gate", "global"])
def test_a_hook_set_after_binding_runs_and_its_removal_binds_again(micro, counted, where) -> None:
    """A forward hook on the norm, the MoE, its gate, or on every module, set after the layer was bound: the
    step's rows go through the modules (the hook sees its call); once it is removed, the one call again."""
    block = copy.deepcopy(micro.layers[3])
    h, pre = _rows(micro.cfg, 2, seed=14)
    seen: list[str] = []

    def hook(module, args) -> None:
        seen.append(type(module).__name__)

    target = {"ffn_norm": block.ffn_norm, "ffn": block.ffn, "gate": block.ffn.gate}.get(where)
    with torch.no_grad():
        first = decode_ffn(block, h, pre)
        if target is None:
            handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        else:
            handle = target.register_forward_pre_hook(hook)
        try:
            hooked = block.ffn_half(h, pre, decode_step=True)
        finally:
            handle.remove()
        assert counted.get("ffn_rows") == 1 and seen
        again = decode_ffn(block, h, pre)
    assert counted.get("ffn_rows") == 2
    assert torch.equal(first[0], hooked[0]) and torch.equal(first[0], again[0])
