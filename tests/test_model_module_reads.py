"""`ModuleReads.holds` and `StepBindings`' stamps, read by the compiled ``reads_hold`` / ``stamps_hold``: each kind of
change a binding must notice makes it fail, equal settings and untouched reads keep it, and without the compiled
kernels no binding holds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kvdiet.formats import native
from kvdiet.model.module_reads import ModuleReads


@pytest.fixture()
def kernels():
    got = native.fp4_kernels()
    if got is None:
        pytest.fail("the compiled kernels did not build")
    return got


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.eps = 1e-6


def _bound(owner: Scaled) -> ModuleReads:
    """The reads a binder would make of ``owner``: its submodule, the submodule's weight, and ``eps``."""
    reads = ModuleReads()
    lin = reads.module(owner, "lin")
    reads.read(lin._parameters, "weight")
    reads.setting(owner, "eps")
    reads.add(owner)
    return reads.freeze()


def test_untouched_reads_and_equal_settings_hold(kernels) -> None:
    owner = Scaled()
    reads = _bound(owner)
    assert reads.holds()
    owner.eps = 1e-6 + 0.0  # an equal value, another object
    owner.lin.weight.data.mul_(2)  # in place: the same parameter object
    assert reads.holds()


@pytest.mark.parametrize(
    "change",
    [
        lambda o: setattr(o.lin, "weight", nn.Parameter(o.lin.weight.detach().clone())),  # another object
        lambda o: o.lin._parameters.pop("weight"),  # absent: None is not it
        lambda o: setattr(o, "lin", nn.Linear(4, 4)),  # another submodule
        lambda o: setattr(o, "eps", 1e-5),  # a setting changed
        lambda o: o.lin.register_forward_hook(lambda *a: None),
        lambda o: o.register_forward_pre_hook(lambda *a: None),
        lambda o: setattr(o.lin, "__class__", type("Sub", (nn.Linear,), {})),  # a subclass runs its own code
        lambda o: setattr(o.lin, "forward", lambda x: x),  # an instance forward
    ],
    ids=["weight", "absent", "submodule", "setting", "hook", "pre-hook", "class", "forward"],
)
def test_each_change_a_binding_must_see_fails_it(kernels, change) -> None:
    owner = Scaled()
    reads = _bound(owner)
    change(owner)
    assert not reads.holds()


def test_a_nan_setting_never_equals_itself(kernels) -> None:
    """As Python's ``==`` (no identity shortcut): a binding that read a NaN setting never holds."""
    owner = Scaled()
    owner.eps = math.nan
    assert not _bound(owner).holds()


def test_a_global_hook_fails_every_binding(kernels) -> None:
    reads = _bound(Scaled())
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not reads.holds()
    finally:
        handle.remove()
    assert reads.holds()


def test_without_the_compiled_kernels_nothing_holds(monkeypatch) -> None:
    reads = _bound(Scaled())
    monkeypatch.setenv(native.ENV, "0")
    assert not reads.holds()


def test_reads_hold_refuses_columns_of_another_shape(kernels) -> None:
    d = {"a": 1}
    with pytest.raises(ValueError, match="different lengths"):
        kernels.reads_hold([], [], [], [d], ["a"], [], [], [], [])
    with pytest.raises(TypeError, match="lists"):
        kernels.reads_hold([], [], [], (d,), ("a",), (1,), [], [], [])
    with pytest.raises(TypeError, match="not a dict"):
        kernels.reads_hold([], [], [], [[1]], ["a"], [None], [], [], [])
    assert kernels.reads_hold([{}], [d], [dict], [d], ["a"], [1], [d], ["a"], [1.0])
    assert not kernels.reads_hold([{1: 2}], [], [], [], [], [], [], [], [])  # a hook dict holding one


def test_stamps_hold_reads_versions_and_data_pointers(kernels) -> None:
    a, b = torch.zeros(3), torch.ones(2)[1:]  # b: a view with a storage offset
    stamps = [a._version, a.data_ptr(), b._version, b.data_ptr()]
    assert kernels.stamps_hold([a, b], stamps)
    a.add_(1)  # the version moves
    assert not kernels.stamps_hold([a, b], stamps)
    stamps[0] = a._version
    b.data = torch.ones(2)  # the storage moves
    assert not kernels.stamps_hold([a, b], stamps)
    with pytest.raises(TypeError, match="two ints"):
        kernels.stamps_hold([a], [0])
    with pytest.raises(TypeError, match="not a tensor"):
        kernels.stamps_hold([1], [0, 0])


def test_a_setting_whose_eq_empties_the_reads_ends_the_check_safely(kernels) -> None:
    """A setting's ``__eq__`` runs Python code mid-check: here it drops the setting from its module and empties the
    reads' columns. Both sides of the comparison are held while it runs, and the shorter columns end the loop."""
    owner = Scaled()

    class Sly:
        __hash__ = None

        def __eq__(self, other: object) -> bool:
            owner.__dict__.pop("eps", None)  # the only reference to the object compared, but for the check's
            for column in reads._equal:
                column.clear()
            return True

    owner.eps = Sly()
    reads = _bound(owner)
    assert reads.holds() is True
    assert reads._equal == ([], [], []) and "eps" not in owner.__dict__
