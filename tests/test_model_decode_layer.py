"""`decode_layer`: a decode step's layer in three compiled calls through weights bound once (`AttnBinding`,
`FfnBinding`), the pieces' bits; bound again whenever the modules change, the pieces wherever a call declines."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model import decode_layer as decode_layer_module
from kvdiet.model.attention import Selection
from kvdiet.model.linear import Linear
from kvdiet.model.transformer import Transformer

PROMPT = torch.arange(2, 40)


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=7)


class Kernels:
    """The compiled kernels counted: ``calls`` of each; those named in ``declines`` return nothing (declined)."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls, self.declines = kernels, {}, set()

    def __getattr__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return (lambda *a, **k: []) if name in self.declines else getattr(self.kernels, name)


@pytest.fixture()
def counted(monkeypatch) -> Kernels:
    kernels = native.fp4_kernels()
    if kernels is None:
        pytest.fail("the compiled kernels did not build")
    proxy = Kernels(kernels)
    monkeypatch.setattr(native, "fp4_kernels", lambda: proxy)
    return proxy


def _hooked(model: Transformer):
    """Hooks on every attention and MoE module: the decode step runs the modules (the pieces)."""
    return [
        module.register_forward_pre_hook(lambda module, args: None)
        for block in model.layers
        for module in (block.attn, block.ffn)
    ]


def _run(model: Transformer, batch: int, tokens: list[int], *, pieces: bool = False) -> torch.Tensor:
    states = [model.new_state() for _ in range(batch)]
    for b, state in enumerate(states):
        model.prefill(state, PROMPT + b)
    hooks = _hooked(model) if pieces else []
    try:
        return torch.cat([model.decode(states, [t + b for b in range(batch)]) for t in tokens])
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_bound_steps_give_the_pieces_logits(micro, counted, batch) -> None:
    model = copy.deepcopy(micro)
    bound = _run(model, batch, [5, 9, 11])
    layers = len(model.layers)
    compressors = sum(block.attn._modules.get("compressor") is not None for block in model.layers)
    assert 0 < compressors < layers
    assert counted.calls.get("attn_head") == counted.calls.get("attn_tail") == 3 * layers
    assert "project_out_rows" not in counted.calls and "ffn_rows" not in counted.calls
    # a layer without a compressor reads its window in attn_head; the others after their compressor step
    assert counted.calls.get("read_fp8_window") == 3 * compressors
    counted.calls.clear()
    assert torch.equal(bound, _run(model, batch, [5, 9, 11], pieces=True))
    assert "attn_head" not in counted.calls and counted.calls.get("project_out_rows") == 3 * layers
    assert counted.calls.get("read_fp8_window") == 3 * layers


def test_a_checked_step_prepares_every_layer_before_the_first(micro, counted, monkeypatch) -> None:
    """Where the step's bindings hold, every layer's rotation and window-read arguments are made once, before the
    first layer runs (`prepare_step`), and each layer runs on them: no layer makes its own; the same logits."""
    model = copy.deepcopy(micro)
    real, made = decode_layer_module._prepare, []
    real_window, windows = decode_layer_module._fused_window, []

    def spy(binding, plan, rows):
        made.append(counted.calls.get("attn_head", 0))  # how many layers had run
        return real(binding, plan, rows)

    def window_spy(attn, plan, rows):
        windows.append(counted.calls.get("attn_head", 0))
        return real_window(attn, plan, rows)

    monkeypatch.setattr(decode_layer_module, "_prepare", spy)
    monkeypatch.setattr(decode_layer_module, "_fused_window", window_spy)
    layers = len(model.layers)
    states = [model.new_state() for _ in range(2)]
    for b, state in enumerate(states):
        model.prefill(state, PROMPT + b)
    logits = torch.cat([model.decode(states, [t, t + 1]) for t in (5, 9, 11)])
    # the first step binds the layers, each on its own; the later ones check them at once and prepare them all
    assert made == list(range(layers)) + [layers] * layers + [2 * layers] * layers
    assert windows == made  # each layer's window arguments too: made once, with the rest
    assert torch.equal(logits, _run(copy.deepcopy(micro), 2, [5, 9, 11], pieces=True))


def _weight(model: Transformer) -> None:
    attn = model.layers[2].attn
    attn.wq_b.weight = torch.nn.Parameter(attn.wq_b.weight * 2, requires_grad=False)


def _eps(model: Transformer) -> None:
    model.layers[1].attn.kv_norm.eps = 0.25


def _linear(model: Transformer) -> None:
    attn = model.layers[3].attn
    lin = Linear(attn.wo_a.in_features, attn.wo_a.out_features)
    lin.weight.data.copy_(attn.wo_a.weight * -1)
    attn.wo_a = lin


def _sink(model: Transformer) -> None:
    model.layers[0].attn.attn_sink = torch.nn.Parameter(torch.full_like(model.layers[0].attn.attn_sink, 3.0))


def _norm_in_place(model: Transformer) -> None:
    model.layers[4].attn_norm.weight[:8].mul_(-2)  # the kernels read the tensor itself


def _expert(model: Transformer) -> None:
    for block in model.layers:  # a routed expert replaced after binding: found after the call, the pieces run
        block.ffn.experts[0] = copy.deepcopy(block.ffn.experts[1])
        block.ffn.experts[0].w2.weight.mul_(-3)


def _scale(model: Transformer) -> None:
    model.layers[5].attn.scale = 0.01


@pytest.mark.parametrize("change", [_weight, _eps, _linear, _sink, _norm_in_place, _expert, _scale])
def test_a_change_after_binding_is_read(micro, counted, change: Callable[[Transformer], None]) -> None:
    """A model bound by one step, then changed (a parameter, a setting, a submodule, an in-place write, a routed
    expert): its next steps are the pieces' with the change, and differ from the unchanged model's."""
    runs = []
    for pieces in (False, True):
        model = copy.deepcopy(micro)
        state = model.new_state()
        model.prefill(state, PROMPT)
        model.decode([state], [5])  # bound (the pieces' run: bound too, then hooked below)
        with torch.no_grad():
            change(model)
        hooks = _hooked(model) if pieces else []
        try:
            runs.append(torch.cat([model.decode([state], [t]) for t in (9, 11)]))
        finally:
            for hook in hooks:
                hook.remove()
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    unchanged = torch.cat([model.decode([state], [t]) for t in (5, 9, 11)])[1:]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], unchanged)


def test_an_observer_or_a_hook_set_after_binding_sees_every_step(micro, counted) -> None:
    """A selection observer or a hook on a projection, set once the layers are bound: the pieces run and see
    each step; removed, the compiled calls again; the logits never change."""
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    first = model.decode([state], [5])
    selections: list[Selection] = []
    seen: list[int] = []
    attn = next(block.attn for block in model.layers if block.info.compress_ratio)
    attn.selection_observer = selections.append
    other = next(block.attn for block in model.layers if block.attn is not attn)
    hook = other.wkv.register_forward_pre_hook(lambda module, args: seen.append(1))
    try:
        heads = counted.calls.get("attn_head", 0)
        hooked = model.decode([state], [9])
        assert selections and seen and counted.calls["attn_head"] == heads + len(model.layers) - 2
    finally:
        hook.remove()
        attn.selection_observer = None
    after = model.decode([state], [11])
    assert counted.calls["attn_head"] == heads + 2 * len(model.layers) - 2
    twin = copy.deepcopy(micro)
    twin_state = twin.new_state()
    twin.prefill(twin_state, PROMPT)
    want = torch.cat([twin.decode([twin_state], [t]) for t in (5, 9, 11)])
    assert torch.equal(torch.cat([first, hooked, after]), want)


@pytest.mark.parametrize("kernel", ["attn_head", "attn_tail"])
def test_a_declining_call_leaves_the_layer_to_the_pieces(micro, counted, kernel) -> None:
    """``attn_head`` declining runs the whole layer's pieces; ``attn_tail`` declining, the attention's tail and
    the FFN half's: the same logits either way."""
    model = copy.deepcopy(micro)
    want = _run(model, 2, [5, 9])
    counted.declines.add(kernel)
    assert torch.equal(_run(model, 2, [5, 9]), want)
    assert counted.calls.get("project_out_rows") == 2 * len(model.layers)


def test_a_copied_model_binds_its_own_weights(micro, counted) -> None:
    model = copy.deepcopy(micro)
    state = model.new_state()
    model.prefill(state, PROMPT)
    model.decode([state], [5])
    assert all(block.attn_binding is not None for block in model.layers)
    twin = copy.deepcopy(model)
    assert all(block.attn_binding is None for block in twin.layers)
