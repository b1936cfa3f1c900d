"""member / members / member_weights: the tensors nn.Module's attribute lookup gives, read from the module's own
dicts where they are held there (parametrized ones as nn.Module resolves them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from kvdiet.model.member import member, member_weights, members


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


def _module() -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.arange(3.0))
    m.register_buffer("table", torch.arange(4))
    m.register_buffer("absent", None)  # registered as None (the router's tid2eid without hash routing)
    m.plain = None  # a plain attribute (the hash router's bias)
    return m


def test_members_read_what_getattr_gives():
    m = _module()
    got = members(m, "weight", "table", "absent", "plain")
    assert got[0] is m.weight and got[1] is m.table
    assert got[2] is None and got[3] is None
    assert [member(m, n) for n in ("weight", "table", "absent", "plain")] == got
    with pytest.raises(AttributeError):
        members(m, "weight", "missing")


def test_parametrized_weights_are_computed_as_on_attribute_access():
    lin, norm = nn.Linear(2, 3, bias=False), nn.Linear(2, 2, bias=False)
    parametrize.register_parametrization(lin, "weight", _Doubled())  # out of _parameters: computed on access
    a, b, none = member_weights(lin, norm, None)
    assert torch.equal(a, lin.parametrizations.weight.original * 2)
    assert b is norm.weight and none is None
    (c,) = members(lin, "weight")
    assert torch.equal(c, a)
    with pytest.raises(AttributeError):
        member_weights(nn.ReLU())
