"""A decode step's block tables: every request's table in one padded tensor, so a layer gathers the batch's
selected entries in one call (`kvdiet.model.decode_step`). It knows pools and tables, not the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiet.formats.codec import Codec
from kvdiet.formats.scales import PendingCheck
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

    def gather(
        self,
        layer: int,
        idx: torch.Tensor,
        counts: list[int],
        codec: Codec,
        pending: list[PendingCheck],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Request b's main-KV entries ``idx[b, :counts[b]]`` of ``layer`` (int64 [B, K], each of those in [0,
        held)), decoded by ``codec``: [B, K, dim], zeros past ``counts[b]`` (host ints: no host read); fp32, or
        bf16 from the compiled call (``fp4.gather_main_kv``: the same values, exactly).

        One compiled call where the codec has one and the requests share a pool (`Codec.fused_gather`); else the
        rows' slots, one ``index_select`` (per request when their pools differ) and one decode, whose stored
        bytes' check joins ``pending`` (`Codec.decode_deferred`; the fused call's failing input runs this path).
        When every count is K (one request, or all past ``index_topk`` entries) the decoded rows are the
        result, with no zero-fill and scatter. ``out``: a buffer [B, K, dim] the compiled call may write the result
        into (and return) where its dtype is the call's; the torch path does not use it.
        """
        b, width = idx.shape
        counts = [min(k, width) for k in counts]
        full = all(k == width for k in counts)
        if not full and not any(counts):
            return torch.zeros(b, width, codec.dim, device=idx.device)
        if self.shared is not None and codec.fused_gather is not None:
            per_block = self.shared.entries_per_block(layer)
            got = codec.fused_gather(self.shared.rows(layer, "main"), self.table, idx, counts, per_block, out)
            if got is not None:
                return got
        at = None  # the flat positions of each request's own columns, from host ints (no host read)
        if not full:
            ranges = [torch.arange(i * width, i * width + k) for i, k in enumerate(counts)]
            at = torch.cat(ranges).to(idx.device)
        slots = self.slots(layer, idx)
        if self.shared is not None:
            flat = slots.flatten() if at is None else slots.flatten().index_select(0, at)
            raw = self.shared.rows(layer, "main").index_select(0, flat)
        else:
            rows = [p.rows(layer, "main") for p in self.pools]
            raw = torch.cat([r.index_select(0, slots[i, : counts[i]]) for i, r in enumerate(rows)])
        if at is None:
            return codec.decode_deferred(raw, pending).view(b, width, codec.dim)
        out = torch.zeros(b * width, codec.dim, device=idx.device)
        out[at] = codec.decode_deferred(raw, pending)
        return out.view(b, width, codec.dim)
