"""`decode_row_ffn`: one request's FFN half in a decode step as four compiled calls, with the module path's bits."""

from __future__ import annotations

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats import native
from kvdiet.model import moe as moe_module
from kvdiet.model.ffn_row import decode_row_ffn
from kvdiet.model.transformer import Transformer


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=5)


def _steps(model: Transformer, batch: int, tokens: list[int]) -> torch.Tensor:
    """Logits of a prefill of 40 tokens then one decode step per token, for each of ``batch`` requests."""
    states = [model.new_state() for _ in range(batch)]
    for i, state in enumerate(states):
        model.prefill(state, torch.arange(2, 42) + i)
    return torch.cat([model.decode(states, [t] * batch) for t in tokens])


def _counting_moe_forward(monkeypatch) -> list[int]:
    calls: list[int] = []
    forward = moe_module.MoE.forward
    monkeypatch.setattr(
        moe_module.MoE, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
    )
    return calls


def test_one_request_runs_the_four_kernels_with_the_module_paths_bits(micro, monkeypatch) -> None:
    """A one-request decode step never enters `MoE.forward`; a forward hook on every MoE (which the flat path
    leaves to the module path) gives the same logits, bit for bit, through it; two requests' steps take it."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    calls = _counting_moe_forward(monkeypatch)
    flat = _steps(micro, 1, [5, 9, 11, 40, 3])
    prefill_calls = len(calls)
    assert prefill_calls > 0  # the prefill's rows take the module path
    calls.clear()
    flat_again = _steps(micro, 1, [5, 9, 11, 40, 3])
    assert len(calls) == prefill_calls  # the decode steps added none
    hooks = [block.ffn.register_forward_pre_hook(lambda module, args: None) for block in micro.layers]
    try:
        calls.clear()
        hooked = _steps(micro, 1, [5, 9, 11, 40, 3])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == prefill_calls + 5 * len(micro.layers)  # every decode step's layer through the module
    assert torch.equal(flat, hooked) and torch.equal(flat, flat_again)
    calls.clear()
    _steps(micro, 2, [5])  # a batch's rows: the module path (its experts grouped across the requests)
    assert len(calls) == 2 * prefill_calls + len(micro.layers)


def test_it_declines_where_the_module_path_must_run(micro, monkeypatch) -> None:
    """Two requests' rows, autograd, the pure-torch path, a kernel that declines: None, nothing changed."""
    if native.fp4_kernels() is None:
        pytest.fail("the compiled kernels did not build")
    block = micro.layers[3]
    h, pre = torch.randn(1, micro.cfg.hc_mult, micro.cfg.hidden_size), torch.rand(1, micro.cfg.hc_mult)
    with torch.no_grad():
        done = decode_row_ffn(block, h, pre)
        assert done is not None
        module = block.ffn_half(h, pre)  # decode_step False: the module path
        assert torch.equal(done[0], module[0]) and torch.equal(done[1], module[1])
        assert decode_row_ffn(block, h.expand(2, -1, -1).contiguous(), pre.expand(2, -1)) is None
        assert decode_row_ffn(block, h.double(), pre) is None
    assert decode_row_ffn(block, h, pre) is None  # autograd on
    with torch.no_grad():
        kernels = native.fp4_kernels()

        class Declining:  # the expert kernel declines (as on a NaN output): the module path runs instead
            def __getattr__(self, name):
                return (lambda *a, **k: None) if name == "expert_groups" else getattr(kernels, name)

        monkeypatch.setattr(native, "fp4_kernels", lambda: Declining())
        assert decode_row_ffn(block, h, pre) is None
        monkeypatch.undo()
        monkeypatch.setenv(native.ENV, "0")
        assert decode_row_ffn(block, h, pre) is None
