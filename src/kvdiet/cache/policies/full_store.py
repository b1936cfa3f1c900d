"""``full-store``: every token's window entries, persisted one payload per block."""

from __future__ import annotations

from collections.abc import Sequence

from kvdiet.cache.plan import WindowSource
from kvdiet.cache.policies.base import SwaPolicy
from kvdiet.cache.spec import CacheSpec

__all__ = ["FullStore"]


class FullStore(SwaPolicy):
    """Every token's window entries, one payload per block in the persistent tier: restore at any block
    boundary from the blocks covering ``[H − W, H)``. Decoder-side replay is off (every row's entries are
    kept, so every row is computed)."""

    name = "full-store"
    store = WindowSource.WINDOW_BLOCKS
    decoder_replay = False

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: Sequence[int]) -> int:
        return num_tokens * spec.window_entry_bytes_per_token

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return 0
