"""`member`: a module's parameter or buffer, read without nn.Module's attribute fallback where it can be.

The decode step reads some 260 weights a step; ``module.weight`` goes through ``nn.Module.__getattr__`` (about a
microsecond each), the module's own dicts take a tenth of that."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["member"]


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
