"""FP8 rounding ties: activations that sit within a few fp32 ulps of an E4M3 rounding midpoint.

Two fp32 implementations of the same model differ by a few ulps (matmul blocking, summation order). Where a
value that is about to be quantised to E4M3 lies that close to the midpoint between two E4M3 values, the two
implementations can round it to different neighbours, and a model as small as a test checkpoint can turn
that one value into a different token. shared/golden/README.md asks to locate such a divergence before
calling it noise; `find_ties` and `flip` do that: record every near-tie of the FP8 activations a forward
quantises (``kvdiet.model.linear``), then re-run with one of them rounded the other way.

This module knows nothing about references or decoding: `kvdiet.model.golden` drives it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvdiet.model.linear import Linear

__all__ = ["Tie", "find_ties", "flip"]

_BLOCK = 32
_E4M3_MIN_EXP = -6  # smallest normal binade of E4M3
_E4M3_MAX = 448.0


@dataclass(frozen=True, slots=True)
class Tie:
    """One activation near an E4M3 rounding midpoint, found during a forward.

    Attributes:
        call: the index of the quantised linear call in that forward (0 = first), ``layer`` its module name.
        index: the element's flat index in the layer's input.
        value: the fp32 input value; ``ulps``: its distance to the midpoint in fp32 ulps of itself.
        rounded / other: the FP8 value used, and the neighbour on the midpoint's other side.
    """

    call: int
    layer: str
    index: int
    value: float
    ulps: float
    rounded: float
    other: float


def _near_ties(
    x: torch.Tensor, q: torch.Tensor, max_ulps: float
) -> list[tuple[int, float, float, float, float]]:
    """``(flat index, value, ulps, rounded, other)`` of every element of ``x`` within ``max_ulps`` of a midpoint."""
    xf = x.reshape(-1, _BLOCK).double()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax.float() / _E4M3_MAX)).double())  # power of two: exact
    y = (xf / scale).abs()
    exp = torch.floor(torch.log2(y.clamp(min=2.0**-30))).clamp(min=_E4M3_MIN_EXP)
    step = torch.exp2(exp - 3)
    lower = torch.floor(y / step) * step
    mid = lower + step / 2
    ulp = torch.exp2(torch.floor(torch.log2(xf.abs().clamp(min=1e-30))) - 23)
    dist = (y - mid).abs() * scale / ulp
    near = (dist <= max_ulps) & (y < _E4M3_MAX) & (y > 0)
    out = []
    qf = q.reshape(-1, _BLOCK).double()
    for flat in near.reshape(-1).nonzero().flatten().tolist():
        r, c = divmod(flat, _BLOCK)
        sign = math.copysign(1.0, float(xf[r, c]))
        lo, hi = float(lower[r, c] * scale[r, 0]), float((lower[r, c] + step[r, c]) * scale[r, 0])
        rounded = float(qf[r, c])
        other = sign * (hi if abs(rounded) == lo else lo)
        out.append((flat, float(xf[r, c]), float(dist[r, c]), rounded, other))
    return out


@contextlib.contextmanager
def find_ties(model: torch.nn.Module, *, max_ulps: float = 4.0) -> Iterator[list[Tie]]:
    """Record the near-ties of every quantised linear call made inside the block, in call order."""
    names = {m: n for n, m in model.named_modules()}
    ties: list[Tie] = []
    calls = [0]

    def hook(layer: Linear, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        for flat, value, ulps, rounded, other in _near_ties(x, q, max_ulps):
            ties.append(Tie(calls[0], names.get(layer, "routed expert"), flat, value, ulps, rounded, other))
        calls[0] += 1
        return q

    with _hook(hook):
        yield ties


@contextlib.contextmanager
def flip(tie: Tie) -> Iterator[None]:
    """Inside the block, the forward's call ``tie.call`` rounds element ``tie.index`` to ``tie.other``."""
    calls = [0]

    def hook(layer: Linear, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if calls[0] == tie.call:
            q = q.clone()
            q.view(-1)[tie.index] = tie.other
        calls[0] += 1
        return q

    with _hook(hook):
        yield


@contextlib.contextmanager
def _hook(hook) -> Iterator[None]:
    if Linear.input_hook is not None:
        raise RuntimeError("a Linear input hook is already installed")
    Linear.input_hook = hook
    try:
        yield
    finally:
        Linear.input_hook = None
