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
    dense = [e.dense_weights() for e in experts]
    limit = experts[0].swiglu_limit
    if any(d is None for d in dense) or any(e.swiglu_limit != limit or _hooked(e) for e in experts):
        return None
    w1_shape, w2_shape = dense[0][0].shape, dense[0][2].shape
    if any(w.dtype != x.dtype for d in dense for w in d) or any(
        d[0].shape != w1_shape or d[1].shape != w1_shape or d[2].shape != w2_shape for d in dense
    ):
        return None
    n, inter, hidden = tokens.shape[0], w1_shape[0], x.shape[1]
    rows = x.index_select(0, tokens)
    gate, up, out = x.new_empty(n, inter), x.new_empty(n, inter), x.new_empty(n, hidden)
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    row_bytes = (inter * x.element_size(), hidden * x.element_size())  # gate and up rows; x and out rows
    if any(t.data_ptr() % _ALIGN for t in (rows, gate, up, out)) or any(
        s * width % _ALIGN for s, _ in bounds for width in row_bytes
    ):
        return None
    for (w1, w3, _), (s, e) in zip(dense, bounds, strict=True):
        _product(rows[s:e], w1, gate[s:e])
        _product(rows[s:e], w3, up[s:e])
    if limit > 0:
        up.clamp_(-limit, limit)
        gate.clamp_(max=limit)
    for s, e in bounds:
        F.silu(gate[s:e], inplace=True)
    act = torch.mul(weights, gate.mul_(up), out=gate)  # weight · (silu(gate) · up)
    for (_, _, w2), (s, e) in zip(dense, bounds, strict=True):
        _product(act[s:e], w2, out[s:e])
    return out


def _hooked(expert: Expert) -> bool:
    """Whether the expert or one of its linears has forward hooks (its forward then runs as a module call, so
    they see it)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in (expert, expert.w1, expert.w3, expert.w2))


def _product(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x · weightᵀ`` by the call `kvdiet.model.gemv.linear` makes for ``x`` [M, K], ``weight`` [N, K]
    (``out`` [M, N], contiguous rows): for more than ``ROWS_MAX`` rows ``F.linear``'s ``torch.mm``, written
    in place."""
    if x.shape[0] > gemv.ROWS_MAX:
        torch.mm(x, weight.t(), out=out)
    else:
        out.copy_(gemv.linear(x, weight))
