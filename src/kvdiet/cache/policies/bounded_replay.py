"""``bounded-replay`` (V4.1): window snapshots only in the short-TTL SWA pool; on a miss, replay the last W."""

from __future__ import annotations

from collections.abc import Callable

from kvdiet.cache.plan import COLD, RestorePlan, WindowSource
from kvdiet.cache.policies.base import BoundaryCapture

__all__ = ["BoundedReplay"]


class BoundedReplay(BoundaryCapture):
    """V4.1: snapshots only in the short-TTL SWA pool; on a pool miss, replay the last W tokens (approximate:
    the replayed windows read nothing below the replay start, v41-spec §7.2). A hit of ≤ W tokens is not
    adopted. Nothing of the window is persisted."""

    name = "bounded-replay"
    store = WindowSource.SWA_POOL
    exact = False

    def plan(
        self,
        hit_tokens: int,
        *,
        window: int,
        num_layers: int,
        align: int,
        has_snapshot: Callable[[int], bool],
    ) -> RestorePlan:
        h = hit_tokens
        if h <= 0:
            return COLD
        if has_snapshot(h):
            return RestorePlan(h, h, WindowSource.SWA_POOL, h)
        if h <= window:
            return COLD
        start = h - window
        start -= start % align
        return COLD if start == 0 else RestorePlan(h, None, None, start, clipped=True)

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return window
