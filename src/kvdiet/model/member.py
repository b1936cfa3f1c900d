"""`member`: a module's parameter or buffer, read without nn.Module's attribute fallback where it can be; and
`overridden`: whether a call of a module runs more than a given class's ``forward`` (the rule by which the
decode step's compiled paths may stand in for a module call), with `stands_in`, which records the ``forward`` a
class's body defined, so that a class-level patch of it (``MoE.forward = wrapper``) is seen.

The decode step reads some 260 weights a step; ``module.weight`` goes through ``nn.Module.__getattr__`` (about a
microsecond each), the module's own dicts take a tenth of that."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module

__all__ = ["member", "overridden", "stands_in"]


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


def stands_in(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: keep the ``forward`` that ``cls``'s body defines as ``cls._own_forward``, the code the
    compiled paths stand in for (`overridden` compares ``cls.forward`` with it). Returns ``cls``.

    Raises:
        TypeError: ``cls``'s body defines no ``forward``.
    """
    own = vars(cls).get("forward")
    if own is None:
        raise TypeError(f"{cls.__name__} defines no forward of its own for a compiled path to stand in for")
    cls._own_forward = own
    return cls


def overridden(module: nn.Module, cls: type[nn.Module]) -> bool:
    """Whether calling ``module`` would run more than ``cls.forward`` as ``cls``'s body defined it (`stands_in`),
    the code a compiled path stands in for: ``module`` of another class (a subclass, e.g. a wrapper, has its own
    ``forward``), ``cls.forward`` replaced on the class (a patch: the module path runs the new code), a
    ``forward`` set on the instance, or a forward hook (its own, or one registered for every module). A class not
    marked `stands_in` counts as overridden."""
    return bool(
        type(module) is not cls
        or vars(cls).get("forward") is not vars(cls).get("_own_forward")
        or "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )
