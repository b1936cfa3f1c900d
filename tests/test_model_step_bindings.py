"""`StepBindings`: every layer's decode bindings checked once per step; any change after they were gathered sends
the step back to the layers' own checks (the pieces' bits), and they are gathered again once the layers rebound."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model import decode_layer, step_bindings
from kvdiet.model.transformer import Transformer

PROMPT = torch.arange(3, 41)


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=9)


@pytest.fixture()
def checks(monkeypatch) -> list[bool]:
    """Whether each decode step's `step_kernels` let every layer skip its own check."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    seen: list[bool] = []
    real = step_bindings.step_kernels

    def spy(model, h):
        kernels = real(model, h)
        seen.append(kernels is not None)
        return kernels

    monkeypatch.setattr(decode_layer, "step_kernels", spy)
    return seen


def _hc_scale(model: Transformer) -> None:
    model.layers[2].hc_attn_fn.normal_(std=0.1, generator=torch.Generator().manual_seed(3))
    model.layers[2].hc_attn_scale.mul_(1.5)  # in place: its version moves, the kept layout is rebuilt


def _weight(model: Transformer) -> None:
    lin = model.layers[1].attn.wkv
    lin.weight = torch.nn.Parameter(lin.weight * 2, requires_grad=False)


def _expert(model: Transformer) -> None:
    for block in model.layers:
        block.ffn.experts[0] = copy.deepcopy(block.ffn.experts[1])
        block.ffn.experts[0].w1.weight.mul_(3)


def _eps(model: Transformer) -> None:
    model.layers[3].ffn_norm.eps = 0.5


def _gate(model: Transformer) -> None:
    model.layers[4].ffn.gate.routed_scaling_factor = 5.0


def _class(model: Transformer) -> None:
    norm = model.layers[0].attn.q_norm

    class Doubled(type(norm)):
        def forward(self, x):
            return 2 * super().forward(x)

    norm.__class__ = Doubled


def _layer(model: Transformer) -> None:
    model.layers[1] = copy.deepcopy(model.layers[1])  # the copy binds its own


class _Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _wrapped_norm(model: Transformer) -> None:
    model.layers[2].attn.q_norm = _Wrapper(model.layers[2].attn.q_norm)  # no eps of its own: the pieces run


def _wrapped_gate(model: Transformer) -> None:
    model.layers[3].ffn.gate = _Wrapper(model.layers[3].ffn.gate)


def _cfg(model: Transformer) -> None:
    model.layers[2].cfg = dataclasses.replace(model.layers[2].cfg, hc_sinkhorn_iters=3)


def _hc_data(model: Transformer) -> None:
    model.layers[1].hc_ffn_fn.normal_(std=0.1, generator=torch.Generator().manual_seed(4))
    model.layers[1].hc_ffn_scale.data.mul_(2)  # no version moves; the kept layout is dropped too
    model.layers[1].hc_weights.clear()


@pytest.mark.parametrize(
    "change",
    [_hc_scale, _weight, _expert, _eps, _gate, _class, _layer, _wrapped_norm, _wrapped_gate, _cfg, _hc_data],
)
def test_a_change_after_the_step_check_holds_is_found(
    micro, checks, change: Callable[[Transformer], None]
) -> None:
    """Three steps (the last two checked once for all layers), a change, two more steps: the first after the
    change goes back to the layers' own checks, and all equal a model changed the same way that runs the pieces."""
    model, twin = copy.deepcopy(micro), copy.deepcopy(micro)
    got, want = [], []
    for m, out in ((model, got), (twin, want)):
        state = m.new_state()
        m.prefill(state, PROMPT)
        hooks = [] if m is model else [b.attn.register_forward_pre_hook(lambda *a: None) for b in m.layers]
        try:
            out += [m.decode([state], [t]) for t in (5, 6, 7)]
            with torch.no_grad():
                change(m)
            out += [m.decode([state], [t]) for t in (8, 9)]
        finally:
            for hook in hooks:
                hook.remove()
    assert checks[:4] == [False, True, True, False]  # first bound, then checked at once, then found changed
    assert torch.equal(torch.cat(got), torch.cat(want))


def test_a_hook_set_after_the_step_check_holds_runs(micro, checks) -> None:
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    first = [model.decode([state], [t]) for t in (5, 6, 7)]
    seen: list[int] = []
    hook = model.layers[2].ffn.gate.register_forward_pre_hook(lambda *a: seen.append(1))
    try:
        hooked = model.decode([state], [8])
    finally:
        hook.remove()
    assert seen and checks == [False, True, True, False]
    assert len(first) == 3 and hooked.shape == first[0].shape


def test_copies_and_pickles_gather_their_own(micro, checks) -> None:
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    for t in (5, 6, 7):
        model.decode([state], [t])
    assert model.step_bindings is not None and copy.deepcopy(model).step_bindings is None


@pytest.mark.parametrize("name", ["Gate", "MoE", "Linear", "RMSNorm"])
def test_a_class_level_patch_of_a_module_forward_runs_in_every_step(micro, checks, monkeypatch, name) -> None:
    """A spy set on the class of modules the compiled calls stand in for (``Gate.forward = spy``), once the step
    check holds: the next step declines the compiled calls and runs the spy in every layer (the router and the MoE
    once a layer, the linears and norms at least that), with the same logits, and the step after it too."""
    from kvdiet.model.layers import RMSNorm
    from kvdiet.model.linear import Linear
    from kvdiet.model.moe import Gate, MoE

    cls = {"Gate": Gate, "MoE": MoE, "Linear": Linear, "RMSNorm": RMSNorm}[name]
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    steps = [model.decode([state], [t]) for t in (5, 6, 7)]
    calls: list[int] = []
    forward = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    spied = model.decode([state], [8])
    monkeypatch.undo()
    steps += [spied, model.decode([state], [9])]
    assert checks[:4] == [False, True, True, False]  # undo() took the checks' spy off as well
    if name in ("Gate", "MoE"):
        assert len(calls) == len(model.layers)
    else:
        assert len(calls) >= len(model.layers)
    twin = copy.deepcopy(micro)
    twin_state = twin.new_state()
    twin.prefill(twin_state, PROMPT)
    want = torch.cat([twin.decode([twin_state], [t]) for t in (5, 6, 7, 8, 9)])
    assert torch.equal(torch.cat(steps), want)


def test_a_model_of_inference_tensors_decodes_through_the_pieces(micro, checks) -> None:
    """Parameters made under ``torch.inference_mode`` keep no version counter (their mHC layout is not kept):
    every step runs, through the pieces, with the logits of the same model made normally."""
    with torch.inference_mode():
        model = Transformer.from_config(load_config("v4.1-micro"), seed=9)
        state = model.new_state()
        model.prefill(state, PROMPT)
        got = torch.cat([model.decode([state], [t]) for t in (5, 6, 7)])
    twin = copy.deepcopy(micro)
    twin_state = twin.new_state()
    twin.prefill(twin_state, PROMPT)
    assert torch.equal(got, torch.cat([twin.decode([twin_state], [t]) for t in (5, 6, 7)]))
    assert checks[:3] == [False, False, False]
