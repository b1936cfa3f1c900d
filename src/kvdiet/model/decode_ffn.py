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

Where the layer's weights are bound (`kvdiet.model.ffn_binding.FfnBinding`, every expert dense and resident) the
four pieces are one compiled call instead (``ffn_rows``, ``formats/layer_kernels.cpp``): the same kernels in the same
order on the same operands, so the same bits; where it declines, the pieces above run.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.ffn_binding import FfnBinding
from kvdiet.model.fused_rows import expert_groups
from kvdiet.model.hc import decode_kernels, hc_expand, sublayer_weights
from kvdiet.model.member import member, overridden
from kvdiet.model.moe import Gate, MoE

if TYPE_CHECKING:
    from kvdiet.model.attn_binding import AttnBinding

__all__ = ["bound_ffn", "bound_sublayer", "decode_ffn"]


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
    if h.dtype != torch.float32 or not h.is_cpu:
        return None
    bound = bound_ffn(block, h)
    if bound is not None:
        kernels, binding = bound
        done = kernels.ffn_rows(h, attn_pre, binding.weights)
        if done is not None and binding.routed_current(done[2]):
            return done[0], done[1]
        if done is not None:  # a routed expert changed since it was bound: the pieces read the modules now
            block.__dict__["ffn_binding"] = None
    if native.fp4_kernels() is None:
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


def bound_ffn(block: nn.Module, h: torch.Tensor) -> tuple[ModuleType, FfnBinding] | None:
    """(the compiled kernels, the layer's `FfnBinding`) for ``ffn_rows`` on streams ``h`` (`bound_sublayer`); the
    caller checks the routed experts after the call (`FfnBinding.routed_current`)."""
    return bound_sublayer(block, h, "ffn", FfnBinding)  # type: ignore[return-value]


def bound_sublayer(
    block: nn.Module, h: torch.Tensor, part: str, binder: type[FfnBinding] | type[AttnBinding]
) -> tuple[ModuleType, FfnBinding | AttnBinding] | None:
    """(the compiled kernels, ``block``'s binding of its ``part`` sublayer, ``"attn"`` or ``"ffn"``, with compiled
    weights) for a decode step's streams ``h``, bound again where the modules changed (``binder.holds``); None where
    the compiled calls do not apply: the rows (`kvdiet.model.hc.decode_kernels`), a block whose decode path is not
    its own (`Block.pieces_own`), an mHC layout not kept (inference tensors: rebuilt each call), or a binding
    without compiled weights."""
    got, own = decode_kernels(h), getattr(block, "pieces_own", None)
    if got is None or own is None or not own():
        return None
    hc = sublayer_weights(block, block.cfg, h, part)
    if block.hc_weights.get(part) is not hc:
        return None
    name = f"{part}_binding"
    binding = block.__dict__.get(name)
    if binding is None or not binding.holds(hc):
        binding = block.__dict__[name] = binder.bind(block, block.cfg, hc, *got)
    return None if binding.weights is None else (got[0], binding)
