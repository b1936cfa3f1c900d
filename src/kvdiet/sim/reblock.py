"""A trace at the block size a model's engine runs at: the smallest multiple of the trace's block size the
engine accepts (`kvdiet.layer_plan.LayerPlan.check_block_size`: a multiple of every compress ratio).

V4-Flash's engine takes only multiples of 128 tokens (its HCA entries span 128), so it writes blocks — and
takes window snapshots at their boundaries — every 128 tokens; a trace of 64-token blocks simulated as they
are would hit, store and snapshot at positions the engine never reaches. `reblock` merges f trace blocks into
one: the trace's ids are chained (`kvdiet.sim.chains`: an id names its whole prefix), so every f-th id names a
whole merged block and the last id a partial tail. It does not know the cache's rules; the simulator runs the
re-blocked trace as any other.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvdiet.config import ModelConfig
from kvdiet.layer_plan import LayerPlan
from kvdiet.sim.traces import Trace

__all__ = ["engine_block_size", "reblock", "reblock_note"]


def engine_block_size(cfg: ModelConfig, trace_block_size: int) -> int:
    """Tokens per block of ``cfg``'s engine on a trace of ``trace_block_size``-token blocks: the least common
    multiple of the two (`LayerPlan.block_unit`). V4-Flash: 128 on a 64-token trace, 512 on Mooncake's."""
    return math.lcm(trace_block_size, LayerPlan.from_config(cfg).block_unit)


def reblock(trace: Trace, block_size: int) -> Trace:
    """``trace`` with blocks of ``block_size`` tokens (``trace`` itself when it has them).

    A request's ids become every f-th id (f = ``block_size / trace.block_size``), one per whole merged block,
    then the last id of the rest when its prompt ends inside a merged block (naming the partial tail, as the
    readers name a partial block). Tokens, times and other fields are kept.

    Raises:
        ValueError: ``block_size`` is not a positive multiple of ``trace.block_size``.
    """
    if block_size < 1 or block_size % trace.block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the trace's {trace.block_size}")
    f = block_size // trace.block_size
    if f == 1:
        return trace
    requests = []
    for r in trace.requests:
        ids = r.hash_ids
        if ids is not None:
            whole = r.input_tokens // block_size * f
            ids = ids[f - 1 : whole : f] + (ids[-1:] if len(ids) > whole else ())
        requests.append(replace(r, hash_ids=ids))
    return replace(trace, requests=requests, block_size=block_size, errors=list(trace.errors))


def reblock_note(model: str, block_size: int, trace_block_size: int) -> str:
    """The one line saying a model runs at blocks other than the trace's, e.g. ``deepseek-v4-flash runs at
    128-token blocks (the trace's 64-token blocks, 2 to a block)``."""
    return (
        f"{model} runs at {block_size:,}-token blocks (the trace's {trace_block_size:,}-token blocks, "
        f"{block_size // trace_block_size:,} to a block)"
    )
