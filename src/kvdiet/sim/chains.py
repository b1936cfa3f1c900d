"""Trace block ids made chained: an id names a whole prefix, as the cache's chained block hashes do.

Mooncake's ``hash_ids`` are chained (the same id at the same position is the same prefix), and the
simulator relies on it: its device pool is a tree of chains (`kvdiet.sim.device_tree`) and its tiers key a
block's global KV by the id alone. A trace from elsewhere may name a block by its content only — the same id
after another prefix (context compaction drops a block, a repeated block of padding, ``[1, 1, 1]``) — or use
negative ids, which the simulator's own ids for blocks the trace never names (counting down from −1) would
meet. `chain_ids` renumbers every trace the readers return: block i of a request gets the number of the pair
(its block i−1's new id, its id), numbers from 0 up in arrival order. On a trace whose ids are already
chained this only renumbers (the same ids stay equal, different ones stay different), so every figure is
unchanged; on any other, a block matches only where its whole prefix does, as in the engine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdiet.sim.traces import TraceRequest

__all__ = ["chain_ids"]


def chain_ids(requests: list[TraceRequest]) -> list[TraceRequest]:
    """``requests`` (in arrival order) with chained ``hash_ids``: ids ≥ 0, equal at position i exactly where
    two requests' ids are equal at every position up to i. Requests without ids (None) are kept as they are."""
    chains: dict[tuple[int, int], int] = {}
    out = []
    for r in requests:
        if r.hash_ids is None:
            out.append(r)
            continue
        ids, parent = [], -1
        for h in r.hash_ids:
            parent = chains.setdefault((parent, h), len(chains))
            ids.append(parent)
        out.append(replace(r, hash_ids=tuple(ids)))
    return out
