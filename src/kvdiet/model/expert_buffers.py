"""A prefill's routed-expert groups run through shared buffers: the values of each `kvdiet.model.moe.Expert`'s own
forward, bit for bit, in fewer torch calls (the MoE of v41-spec §8.2a; DeepSeek's reference ``Expert``).

`kvdiet.model.moe.MoE` sorts the (token, slot) pairs by expert; group g is rows ``[s_g, e_g)`` of the sorted
pairs. Each expert's forward is ``w2 · (weight · silu(clamp(w1·x)) · clamp(w3·x))``. Here every group's rows are
gathered at once into one buffer, each group's ``w1·x`` and ``w3·x`` are written into its rows of two buffers
and its ``w2`` product into its rows of the output, by the very matmul `Linear.forward` runs on that group
(`kvdiet.model.gemv.linear`: the compiled row products for at most ``ROWS_MAX`` rows, else ``F.linear``, whose
2-d product is ``torch.mm`` with the weight transposed), over operands of the same shapes and strides, each
starting 64-byte aligned as a fresh tensor does (else the groups run as before). ``silu`` runs on each group's
rows alone, as in the expert's forward: its CPU kernel rounds an element by where it falls in the run it is
given (vector body or scalar tail). The clamps and both products (by ``up``, then the routing weight, in the
forward's operand order) are exact IEEE operations applied element by element, so they run once over all
groups; so do the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvdiet.model import gemv

if TYPE_CHECKING:
    from kvdiet.model.moe import Expert

__all__ = ["run_sorted_groups"]

_ALIGN = 64  # bytes: the CPU allocator's alignment of a fresh tensor's data


def run_sorted_groups(
    x: torch.Tensor,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    counts: Sequence[int],
    experts: Sequence[Expert],
) -> torch.Tensor | None:
    """The routed outputs ``experts[g](x[tokens[s_g:e_g]], weights[s_g:e_g])`` of every group, stacked in group
    order: the rows `MoE` concatenates, bit for bit.

    Args:
        x: fp32 or fp64 [T, hidden] on the CPU, the layer's rows.
        tokens: int64 [N], the sorted pairs' rows of ``x``; ``weights`` [N, 1] their routing weights, x's dtype.
        counts: rows per group (each ≥ 1, summing to N); ``experts``: each group's `Expert`.
    Returns:
        [N, hidden] in x's dtype; None where this path does not apply (gradients enabled, off the CPU, an expert
        not dense or of another dtype or with forward hooks, shapes or clamps that differ between experts, a
        buffer slice not 64-byte aligned), where the caller runs each expert's forward.
    """
    if (
        torch.is_grad_enabled()
        or not x.is_cpu
        or weights.dtype != x.dtype
        or weights.shape != (tokens.shape[0], 1)
    ):
        return None
    limit, dense = experts[0].swiglu_limit, []
    for e in experts:
        d = e.dense_weights()
        if d is None or e.swiglu_limit != limit or _hooked(e):
            return None
        dense.append(d)
    dt, w1_shape, w2_shape = x.dtype, dense[0][0].shape, dense[0][2].shape
    for w1, w3, w2 in dense:
        if w1.dtype != dt or w3.dtype != dt or w2.dtype != dt:
            return None
        if w1.shape != w1_shape or w3.shape != w1_shape or w2.shape != w2_shape:
            return None
    n, inter, hidden = tokens.shape[0], w1_shape[0], x.shape[1]
    rows = x.index_select(0, tokens)
    gate, up, out = x.new_empty(n, inter), x.new_empty(n, inter), x.new_empty(n, hidden)
    row_bytes = (inter * x.element_size(), hidden * x.element_size())  # gate and up rows; x and out rows
    start = 0
    for count in counts:
        if any(start * width % _ALIGN for width in row_bytes):
            return None
        start += count
    if any(t.data_ptr() % _ALIGN for t in (rows, gate, up, out)):
        return None
    # each group's rows of every buffer: views as ``buffer[s_g:e_g]``, made in one call per buffer
    sizes = list(counts)
    xs, gates, ups, outs = rows.split(sizes), gate.split(sizes), up.split(sizes), out.split(sizes)
    for (w1, w3, _), xg, g, u in zip(dense, xs, gates, ups, strict=True):
        _product(xg, w1, g)
        _product(xg, w3, u)
    if limit > 0:
        up.clamp_(-limit, limit)
        gate.clamp_(max=limit)
    for g in gates:
        F.silu(g, inplace=True)
    torch.mul(weights, gate.mul_(up), out=gate)  # weight · (silu(gate) · up), each group's rows still `gates`
    for (_, _, w2), a, o in zip(dense, gates, outs, strict=True):
        _product(a, w2, o)
    return out


def _hooked(expert: Expert) -> bool:
    """Whether the expert or one of its linears has forward hooks (its forward then runs as a module call, so
    they see it)."""
    mods = expert._modules  # no nn.Module attribute fallback (about a microsecond a lookup)
    return any(m._forward_hooks or m._forward_pre_hooks for m in (expert, mods["w1"], mods["w3"], mods["w2"]))


def _product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x · weightᵀ`` by the call `kvdiet.model.gemv.linear` makes for ``x`` [M, K], ``weight`` [N, K]
    (``out`` [M, N], contiguous rows): for more than ``ROWS_MAX`` rows ``F.linear``'s ``torch.mm``, written
    in place."""
    if x.shape[0] > gemv.ROWS_MAX:
        torch.mm(x, weight.t(), out=out)
    else:
        out.copy_(gemv.linear(x, weight))
