"""A decode step's FFN half (one row per request, up to 16) without the MoE's module layers.

`Block.ffn_half` on a decode step's rows goes through some 95 Python calls a layer: the mHC entry and exit,
``nn.Module.__call__`` of the MoE and of its gate, `MoE.forward` and its one-row or grouped expert path, then the
experts' wrapper; measured on v4.1-mini, 35–50 µs a layer on warm caches against the ~60 µs of one request's
kernels. `decode_ffn` calls the same pieces the module path ends in, once each and in its order: the mHC entry
(`Block.entry`), `Gate.forward`, the experts fetched as the module path fetches them and run in one
``expert_groups`` call (`kvdiet.model.fused_rows.expert_groups`), the mHC exit (`hc_expand`). Each of those
keeps its own checks and its own torch fallback, so the result is the module path's, bit for bit. Where the
experts' call declines (a NaN output, a routed expert stored quantised), the MoE module itself computes the
output from the same rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.fused_rows import expert_groups
from kvdiet.model.hc import hc_expand
from kvdiet.model.member import member, overridden
from kvdiet.model.moe import Gate, MoE

__all__ = ["decode_ffn"]


def decode_ffn(
    block: nn.Module, h: torch.Tensor, attn_pre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Block.ffn_half` of a decode step's rows without the MoE's module layers, or None where it does not
    apply (the caller runs the module path).

    Args:
        block: a `kvdiet.model.block.Block`.
        h: the streams fp32 [B, hc, hidden] on the CPU, B = 1..16 (one row per request); attn_pre: the attention
            sublayer's pre-mix fp32 [B, hc].
    Returns:
        ``(new streams fp32 [B, hc, hidden], this FFN's pre [B, hc])``, the bits of the module path; None with
        autograd on, other shapes, dtypes or devices, no compiled kernels (the pure-torch path), a hash-routed
        gate, a shared expert not stored dense (the released checkpoint's FP8 experts: nothing is computed then),
        or ``ffn`` or its gate not exactly `MoE` / `Gate` or given a forward hook or an instance ``forward`` (the
        module path runs those).
    """
    if torch.is_grad_enabled() or h.dim() != 3 or not 1 <= h.shape[0] <= gemv.ROWS_MAX:
        return None
    if h.dtype != torch.float32 or not h.is_cpu or native.fp4_kernels() is None:
        return None  # without the compiled kernels the experts' call always declines: the module path
    moe = block._modules["ffn"]
    gate = moe._modules.get("gate")
    # the module path calls ``moe`` and its gate: another module there, a subclass or a forward set on the
    # instance runs its own code, and a hook runs
    if overridden(moe, MoE) or overridden(gate, Gate):
        return None
    shared = moe._modules["shared_experts"]
    # quantised experts (the released checkpoint's) never take the experts' one call: decline before anything
    # is computed or fetched (the module path would do it all again)
    if member(gate, "tid2eid") is not None or shared.dense_weights() is None:
        return None
    x, pre, post, comb = block.entry(h, "ffn", attn_pre)
    weights, ids = gate.forward(x)
    # the experts named, fetched in the module path's order (one row: `MoE._one_row`'s routing order; more:
    # `MoE._routed_grouped`'s increasing ids), so an expert cache sees the same reads; then increasing, its
    # ``used`` (each row names an expert at most once, so at most 16 pairs each: decode rows)
    rows = ids.tolist()
    named = rows[0] if len(rows) == 1 else sorted({e for row in rows for e in row})
    by_id = dict(zip(named, moe.fetch(named), strict=True))
    used = sorted(by_id)
    out = expert_groups(x, weights, ids, used, [by_id[e] for e in used], shared)
    if out is None:  # the experts' call declined: the module's own path over the same rows (its bits)
        out = moe(x, padded=True)
    return hc_expand(out, h, post, comb), pre
