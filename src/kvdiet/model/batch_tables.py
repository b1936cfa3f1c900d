"""A decode step's block tables: every request's table in one padded tensor, so a layer gathers the batch's
selected entries in one call (`kvdiet.model.decode_step`). It knows pools and tables, not the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiet.model.attention import Segment
from kvdiet.model.index_scores import StoredKeys
from kvdiet.model.paged_pool import DevicePool

__all__ = ["BatchTables"]


@dataclass(frozen=True, slots=True)
class BatchTables:
    """The batch's block tables, one row per request padded with block 0: request b's entry j of a layer with
    ``per_block`` entries per block sits in pool row ``table[b, j // per_block]·per_block + j % per_block``.

    When the requests share one pool (an engine's), the rows end to end are one table: request b's entry j is
    entry ``offsets[b] + j`` of the layer's `StoredKeys` over it (`keys`).

    Attributes:
        pools: each request's pool.
        table: int64 [B, most blocks] on the pools' device.
        shared: the pool every request uses, or None when they differ (models used without an engine).
    """

    pools: list[DevicePool]
    table: torch.Tensor
    shared: DevicePool | None

    @classmethod
    def of(cls, segs: list[Segment]) -> BatchTables:
        tables = [seg.state.table for seg in segs]
        pools = [t.pool for t in tables]
        shared = pools[0] if all(p is pools[0] for p in pools) else None
        rows = [t.tensor() for t in tables]  # each table's cached ids on its pool's device (no list → tensor)
        sizes = [r.numel() for r in rows]
        if min(sizes) == max(sizes) > 0:  # no padding (requests of a length): one copy
            return cls(pools, torch.stack(rows), shared)
        table = torch.zeros(len(rows), max(1, *sizes), dtype=torch.int64, device=pools[0].device)
        for b, r in enumerate(rows):
            table[b, : r.numel()] = r
        return cls(pools, table, shared)

    def slots(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """Pool rows int64 [B, C] of request b's entries ``idx[b]`` (int64 [B, C], each in [0, held))."""
        per_block = self.pools[0].entries_per_block(layer)
        # torch.div, not ``//`` (Tensor.__floordiv__ is a Python wrapper); the same values
        blocks = self.table.gather(1, torch.div(idx, per_block, rounding_mode="floor"))
        return blocks.mul_(per_block).add_(idx % per_block)

    def keys(self, layer: int, kind: str) -> StoredKeys:
        """Every request's entries of ``layer`` and ``kind`` (``"main"`` or ``"index"``) as one `StoredKeys`
        over the shared pool (see `offsets`)."""
        per_block = self.shared.entries_per_block(layer)
        table = self.table.flatten()
        return StoredKeys(self.shared.rows(layer, kind), table, per_block, table.numel() * per_block)

    def offsets(self, layer: int) -> torch.Tensor:
        """int64 [B]: request b's entry j of ``layer`` is entry ``offsets[b] + j`` of `keys`."""
        b, width = self.table.shape
        return torch.arange(b, device=self.table.device) * (width * self.pools[0].entries_per_block(layer))
