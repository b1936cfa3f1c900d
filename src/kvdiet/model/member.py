"""`member`: a module's parameter or buffer, read without nn.Module's attribute fallback where it can be; and
`overridden`: whether a call of a module runs more than a given class's ``forward`` (the rule by which the
decode step's compiled paths may stand in for a module call).

The decode step reads some 260 weights a step; ``module.weight`` goes through ``nn.Module.__getattr__`` (about a
microsecond each), the module's own dicts take a tenth of that."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module

__all__ = ["member", "overridden"]


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


def overridden(module: nn.Module, cls: type[nn.Module]) -> bool:
    """Whether calling ``module`` would run more than ``cls.forward``, the code a compiled path stands in for:
    ``module`` of another class (a subclass, e.g. a wrapper, has its own ``forward``), a ``forward`` set on the
    instance, or a forward hook (its own, or one registered for every module)."""
    return bool(
        type(module) is not cls
        or "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )
