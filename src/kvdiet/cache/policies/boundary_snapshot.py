"""``boundary-snapshot`` (the V4 deployment): one window snapshot per prompt/output end, persisted."""

from __future__ import annotations

from collections.abc import Sequence

from kvdiet.cache.plan import WindowSource
from kvdiet.cache.policies.base import BoundaryCapture

__all__ = ["BoundarySnapshot"]


class BoundarySnapshot(BoundaryCapture):
    """V4 deployment: one window snapshot per prompt/output end, in the persistent tier; a hit at a stored
    boundary restores it, any other hit recomputes the exact dependency window."""

    name = "boundary-snapshot"
    store = WindowSource.PERSISTENT

    def persisted_snapshots(self, num_tokens: int, *, boundaries: Sequence[int]) -> Sequence[int]:
        return boundaries

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return 0
