"""`place`: move a V4.1 model to a device, including the tensors ``Module.to`` does not see.

``Module.to`` moves parameters and buffers (here every one not on the meta device: routed experts and
Engram tables a checkpoint serves on first use stay there). A `Transformer` also holds tensors outside them, each moved
here: every layer's RoPE frequencies (`kvdiet.model.layers.Rope`, a frozen value: replaced by a copy on the
device, so ``Rope.at``'s ``freqs.to(positions.device)`` is a no-op in the forward), the Engram hasher's token map,
bucket primes, offsets and multipliers, and the routed-expert cache's target device (experts read on first
use are built on the host and moved, `kvdiet.model.expert_cache`). Pools and request states made afterwards
by ``new_pool``/``new_state`` follow ``model.device``. `tensors_off_device` lists whatever is left behind;
the tests run it after a prefill and a decode.

It knows nothing of engines or caches beyond the model's own objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from kvdiet.model.layers import Rope
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.setting_error import SettingError

__all__ = ["place", "tensors_off_device"]


def place(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move ``model`` (a V4.1 `Transformer`, built on the CPU) and its non-parameter tensors to ``device``;
    returns it. Call before any pool or state is made (those are allocated on ``model.device``).

    Raises:
        SettingError (a ValueError): ``model`` is a V4-Flash baseline and ``device`` is not the CPU (its caches
            are host-only); named as the keyword ``device='cuda'``, or the flag ``--device cuda`` in
            `SettingError.as_flags`.
    """
    device = torch.device(device)
    if not isinstance(model, Transformer):
        if device.type != "cpu":
            raise SettingError("{device=}: the V4-Flash baseline model runs on the CPU only", device=device)
        return model
    if device == model.device:
        return model
    # tensors a checkpoint serves on first use stay on the meta device (Module.to refuses those)
    model._apply(lambda t: t if t.is_meta else t.to(device))
    for module in model.modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, Rope):
            module.rope = dataclasses.replace(rope, freqs=rope.freqs.to(device))
        routed = getattr(module, "routed", None)
        if routed is not None:
            routed.cache.device = device
    if model.hasher is not None:
        model.hasher.to(device)
    return model


def _model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
    for name, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, Rope):
            yield f"{name}.rope.freqs", rope.freqs
    hasher = getattr(model, "hasher", None)
    if hasher is not None:
        yield from ((f"hasher.{name}", t) for name, t in hasher.tensors().items())


def _state_tensors(state: RequestState) -> Iterator[tuple[str, torch.Tensor]]:
    for i, ring in enumerate(state.windows):
        yield f"windows[{i}].rows", ring.rows
        yield f"windows[{i}].positions", ring.positions
    for layer, tail in state.tails.items():
        yield f"tails[{layer}].kv", tail.kv
        yield f"tails[{layer}].score", tail.score
    yield "engram_history", state.engram_history
    yield "table", state.table.tensor()
    for (layer, kind), pages in state.table.pool.pages().items():
        yield f"pool[{layer}, {kind}]", pages


def tensors_off_device(model: nn.Module, states: list[RequestState], device: torch.device) -> list[str]:
    """Names of every tensor of ``model`` (parameters, buffers, RoPE tables, Engram hasher) and of
    ``states`` (window rings, compressor tails, Engram history, block table, their pool's pages) that is not
    on ``device``; empty when all are."""
    named = list(_model_tensors(model))
    for i, state in enumerate(states):
        named += [(f"state[{i}].{n}", t) for n, t in _state_tensors(state)]
    return [f"{n} on {t.device}" for n, t in named if t.device != device]
