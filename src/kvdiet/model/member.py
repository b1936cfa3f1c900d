"""`member`: a module's parameter or buffer, read without nn.Module's attribute fallback where it can be;
`members` (several of one module) and `member_weights` (the ``weight`` of several modules) in one call each.

The decode step reads some 1,100 weights a step; ``module.weight`` goes through ``nn.Module.__getattr__`` (about a
microsecond each), the module's own dicts take a tenth of that, and one call for a layer's few saves a Python
frame per weight."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["member", "member_weights", "members"]


def member(module: nn.Module, name: str) -> torch.Tensor | None:
    """``getattr(module, name)`` for a parameter or buffer ``name``: read from the module's own ``_parameters``
    or ``_buffers`` dict where it is held there (nn.Module's attribute fallback costs about a microsecond a
    lookup), else the attribute as nn.Module resolves it: a parametrized or pruned parameter
    (``torch.nn.utils.parametrize`` and ``prune`` take it out of ``_parameters`` and compute it on access).

    Raises:
        AttributeError: ``module`` has no attribute ``name``.
    """
    params = module._parameters
    if name in params:
        return params[name]
    buffers = module._buffers
    if name in buffers:
        return buffers[name]
    return getattr(module, name)


def members(module: nn.Module, *names: str) -> list[torch.Tensor | None]:
    """``[member(module, name) for name in names]`` in one call (a decode step reads a block's three mHC
    parameters twice a layer and a router's three tensors once).

    Raises:
        AttributeError: ``module`` has no attribute of one of ``names``.
    """
    params, buffers = module._parameters, module._buffers
    out = []
    for name in names:
        out.append(
            params[name] if name in params else buffers[name] if name in buffers else getattr(module, name)
        )
    return out


def member_weights(*modules: nn.Module | None) -> list[torch.Tensor | None]:
    """``member(m, "weight")`` of each of ``modules`` (None for a None module) in one call: a decode step's fused
    projections read two or three weights each, 120 calls a step.

    Raises:
        AttributeError: a module has no attribute ``weight``.
    """
    out = []
    for module in modules:
        got = None if module is None else module._parameters.get("weight")
        out.append(got if got is not None or module is None else member(module, "weight"))
    return out
