"""The calls that copy a tensor's values to the host, counted by the kvdiet line that makes them.

On a GPU each such read (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, a ``nonzero``) waits for the device
to finish everything queued before it: a decode step with hundreds of them cannot overlap its launches, and none
can be captured in a CUDA graph. `HostReads` counts them on any device, the CPU included, through a
``torch.overrides.TorchFunctionMode`` (`benchmarks/bench_host_reads.py` runs it over a decode step; the tests
hold single checks to one read).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["READS", "HostReads"]

READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.numpy: "numpy",
}
"""The calls that copy a tensor's values to the host (on a GPU: a device synchronisation each), by kind."""


class HostReads(TorchFunctionMode):
    """While entered (``with HostReads() as reads:``), counts `READS` calls in ``sites`` by (kind, the innermost
    ``kvdiet/`` file:line on the stack, "?" outside kvdiet); ``total`` is their sum. Other calls run unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[tuple[str, str]] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = READS.get(func)
        if kind is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/kvdiet/" in f.filename]
            where = f"{frames[-1].filename.split('/kvdiet/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.sites[(kind, where)] += 1
        return func(*args, **(kwargs or {}))
