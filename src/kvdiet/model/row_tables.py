"""What every layer of one forward call computes alike from a request's rows, computed once per call: the RoPE
rotations at the rows' positions (one per RoPE table, v41-spec §2) and, when no window entry precedes the rows,
the window bands' mask (`kvdiet.model.attention.Attention.window_band`).

Each is the very tensor a layer would compute for itself (the same function of the same inputs), so sharing it
changes no value; a `kvdiet.model.attention.Segment` holds one `RowTables` for its rows and a narrowed segment
(`Segment.last_rows`) starts a new one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdiet.model.layers import Rope, Rotation

__all__ = ["RowTables"]


class RowTables:
    """One segment's shared tables for one forward call (empty until a layer asks).

    Rotations are keyed as `Rope.for_layer` tells a model's tables apart: ``(rope_dim, base, yarn)`` (the layers of
    one table share one entry); band masks by ``(window, floor)``.
    """

    __slots__ = ("_bands", "_rotations")

    def __init__(self) -> None:
        self._rotations: dict[tuple[int, float, bool], Rotation] = {}
        self._bands: dict[tuple[int, int], torch.Tensor] = {}

    def rotation(self, rope: Rope, positions: torch.Tensor) -> Rotation:
        """``rope.at(positions)`` (``positions`` int64 [T]: the segment's rows, the same on every call of this
        object), computed on the first call for that table and shared afterwards."""
        key = (rope.rope_dim, rope.base, rope.yarn)
        rot = self._rotations.get(key)
        if rot is None:
            rot = self._rotations[key] = rope.at(positions)
        return rot

    def band_mask(self, window: int, floor: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The band mask bool [T, window] of rows with no window entry before them, ``make()`` on the first call
        for ``(window, floor)``; the caller guarantees it depends on nothing else (read-only: never modify it)."""
        mask = self._bands.get((window, floor))
        if mask is None:
            mask = self._bands[(window, floor)] = make()
        return mask
