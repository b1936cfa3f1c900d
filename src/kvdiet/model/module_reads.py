"""`ModuleReads`: what a binding of compiled weights (`kvdiet.model.ffn_binding`, `kvdiet.model.attn_binding`)
read from a layer's modules, checked again before each decode step in compiled loops (``formats/reads_kernels.cpp``).

A module path reads its weights through Python lookups on every call; a binding reads them once. It stays valid
while every object it read is still the one its dict holds (``same``: modules, parameters, buffers; identity),
every setting still has its value (``equal``: eps, top-k, scaling factors; equality), every module is still of the
class bound (``types``: a ``__class__`` swapped for a subclass runs that class's code) and no forward hook is
registered on any of them or for every module (``hooks``: the module path would run it). The same rule as
`kvdiet.model.member.overridden`, read for all of a layer's modules at once, in C loops (``reads_hold``).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as nn_module

from kvdiet.formats import native

__all__ = ["ModuleReads", "Transient"]


class Transient:
    """A binding kept on a module (`AttnBinding`, `FfnBinding`, `StepBindings`): a copied or pickled module drops it
    and binds again on its first decode step (a compiled weights object neither copies nor pickles, and would hold
    the original's tensors)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (_dropped, ())


def _dropped() -> None:
    return None


class ModuleReads:
    """The reads of one binding, each kept as columns (dicts, keys, objects) so a check is a few ``map`` passes.

    Build with `read` / `setting` / `module` while reading the weights, then `freeze`; `holds` checks them.
    """

    __slots__ = ("_classes", "_equal", "_hooks", "_modules", "_same", "_settings", "overridden")

    def __init__(self) -> None:
        self._same: list[tuple[dict, str, object]] = []
        self._settings: list[tuple[dict, str, object]] = []
        self._modules: list[nn.Module] = []
        self._classes: list[type] = []
        self._hooks: list[dict] = []
        self._equal: tuple = ()
        # when frozen, a forward hook was set or a module had an instance ``forward``: the binding must not stand in
        # for the modules (`kvdiet.model.member.overridden`, given the classes the binder checks)
        self.overridden = False

    def read(self, owner: dict, key: str) -> object:
        """``owner[key]`` (None where absent), recorded to be found again by identity."""
        value = owner.get(key)
        self._same.append((owner, key, value))
        return value

    def expect(self, owner: dict, key: str, value: object) -> None:
        """Record that ``owner[key]`` must be ``value`` (by identity), whatever it holds now."""
        self._same.append((owner, key, value))

    def setting(self, module: nn.Module, name: str) -> object:
        """``module.name`` from the instance's own dict, recorded to be found again by equality."""
        value = module.__dict__[name]
        self._settings.append((module.__dict__, name, value))
        return value

    def module(self, owner: nn.Module, name: str) -> nn.Module:
        """Submodule ``owner.name``, recorded with its class, its hooks and the absence of an instance ``forward``.

        Raises:
            KeyError: ``owner`` has no submodule ``name``.
        """
        child = owner._modules[name]
        self.read(owner._modules, name)
        self.add(child)
        return child

    def of_class(self, obj: object) -> None:
        """Record ``obj``'s class alone (an object the step never calls as a module: no hooks to check)."""
        self._modules.append(obj)  # type: ignore[arg-type]
        self._classes.append(type(obj))

    def add(self, module: nn.Module) -> None:
        """Record ``module`` itself (reached by the caller): its class, its hooks, no ``forward`` on the instance."""
        self._modules.append(module)
        self._classes.append(type(module))
        self._hooks += [module._forward_hooks, module._forward_pre_hooks]
        self._same.append((module.__dict__, "forward", None))

    def freeze(self) -> ModuleReads:
        """Lay the reads out as columns and note whether a hook or an instance ``forward`` is set now
        (``overridden``); returns self."""
        self._same = _columns(self._same)  # type: ignore[assignment]
        self._equal = _columns(self._settings)
        self.overridden = self._hooks_set() or any("forward" in m.__dict__ for m in self._modules)
        return self

    @classmethod
    def joined(cls, parts: list[ModuleReads]) -> ModuleReads:
        """One frozen `ModuleReads` of all of ``parts`` (each frozen): its `holds` is theirs together."""
        joined = cls()
        for part in parts:
            joined._modules += part._modules
            joined._classes += part._classes
            joined._hooks += part._hooks
            joined.overridden = joined.overridden or part.overridden
        joined._same = _joined([part._same for part in parts])  # type: ignore[assignment]
        joined._equal = _joined([part._equal for part in parts])
        return joined

    def holds(self) -> bool:
        """Whether every read finds the same object and setting, every module its class, and no hook is set (nor
        was one, or an instance ``forward``, when frozen: such a binding is read again each time, so it applies
        once they are gone). The reads run in C loops (``reads_hold``, ``formats/reads_kernels.cpp``; their cost:
        `kvdiet.model.step_bindings`); without the compiled kernels a binding, which stands in for the modules
        only through them, never holds."""
        if self.overridden or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return False
        kernels = native.fp4_kernels()
        return kernels is not None and kernels.reads_hold(
            self._hooks, self._modules, self._classes, *self._same, *self._equal
        )

    def _hooks_set(self) -> bool:
        return bool(
            nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks or any(self._hooks)
        )


def _joined(columns: list) -> tuple[list, list, list]:
    return tuple([item for column in columns for item in column[i]] for i in range(3))  # type: ignore[return-value]


def _columns(rows: list[tuple[dict, str, object]]) -> tuple[list[dict], list[str], list[object]]:
    if not rows:
        return [], [], []
    dicts, keys, values = zip(*rows, strict=True)
    return list(dicts), list(keys), list(values)
