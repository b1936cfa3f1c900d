"""Routed experts read from the checkpoint on first use and kept in an LRU bounded by bytes.

The released V4.1-Flash checkpoint holds ~260 GB of routed experts (40 layers × 384 experts × 3 FP4
matrices); a token uses 6 per layer. With `ExpertCache` a model built from a checkpoint keeps only the
experts it has used recently: an expert is read (``Checkpoint.read``, positioned reads, no mapping) when the
router first picks it, kept while the resident experts fit ``budget_bytes``, and the least recently used
ones are dropped to make room. An expert larger than the budget is still loaded for the call that needs it
(the budget is a target, never a refusal). Numerics do not depend on the budget: a re-read expert holds the
same bytes.

This module knows nothing about where experts sit in the checkpoint: the loader passes a ``build(layer,
expert)`` function that reads one and returns a resident module.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ExpertCache", "ExpertCacheStats", "LayerExperts"]


@dataclass(frozen=True, slots=True)
class ExpertCacheStats:
    """Counters since start. ``loads``: experts read from the checkpoint (``bytes_read`` in all); ``hits``:
    uses served from memory; ``evictions``: experts dropped for room; ``resident_bytes`` / ``peak_bytes``:
    expert bytes held now / at most; ``budget_bytes``: the target."""

    loads: int
    hits: int
    evictions: int
    bytes_read: int
    resident_bytes: int
    peak_bytes: int
    budget_bytes: int


class ExpertCache:
    """An LRU of resident experts keyed by ``(layer, expert)``, bounded by ``budget_bytes``.

    Args:
        build: reads expert ``e`` of layer ``l`` and returns ``(module, bytes it holds)``.
        budget_bytes: resident expert bytes to stay within (≥ 0).
    Raises:
        ValueError: a negative budget.
    """

    def __init__(self, build: Callable[[int, int], tuple[nn.Module, int]], budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"expert cache budget must be >= 0 bytes, got {budget_bytes}")
        self._build, self.budget_bytes = build, budget_bytes
        self.device = torch.device("cpu")  # where read experts go (`kvdiet.model.placement.place` sets it)
        self._lru: OrderedDict[tuple[int, int], tuple[nn.Module, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._loads = self._hits = self._evictions = self._bytes_read = 0
        self._resident = self._peak = 0

    def get(self, layer: int, expert: int) -> nn.Module:
        """The resident module of ``expert`` in ``layer``, read on a miss (evicting LRU experts first)."""
        key = (layer, expert)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self._hits += 1
                return hit[0]
        with torch.device("cpu"):  # read on the host (positioned reads), then moved to the model's device
            module, nbytes = self._build(layer, expert)
        module = module.to(self.device)
        with self._lock:
            while self._lru and self._resident + nbytes > self.budget_bytes:
                _, (_, dropped) = self._lru.popitem(last=False)
                self._resident -= dropped
                self._evictions += 1
            if key not in self._lru:
                self._lru[key] = (module, nbytes)
                self._resident += nbytes
            self._loads += 1
            self._bytes_read += nbytes
            self._peak = max(self._peak, self._resident)
        return module

    def layer(self, layer: int) -> LayerExperts:
        """The experts of one MoE layer, indexable by expert id."""
        return LayerExperts(self, layer)

    def stats(self) -> ExpertCacheStats:
        with self._lock:
            return ExpertCacheStats(
                self._loads,
                self._hits,
                self._evictions,
                self._bytes_read,
                self._resident,
                self._peak,
                self.budget_bytes,
            )


@dataclass(frozen=True, slots=True)
class LayerExperts:
    """``experts[e]`` of one layer through the shared `ExpertCache` (what `kvdiet.model.moe.MoE` indexes)."""

    cache: ExpertCache
    layer_id: int

    def __getitem__(self, expert: int) -> nn.Module:
        return self.cache.get(self.layer_id, expert)
