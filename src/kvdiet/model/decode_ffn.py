"""A decode step's FFN half (one row per request, up to 16) as its four compiled calls, with no Python layer
between them.

`Block.ffn_half` on a decode step's rows goes through some 95 Python calls a layer (the mHC entry and exit
wrappers, ``nn.Module.__call__`` of the MoE and its gate, `MoE.forward`, the expert path and its wrapper), each
checking what the one before already knew: measured on v4.1-mini, 35–50 µs a layer on warm caches against the
~60 µs of one request's kernels, so a decode step spent more than a millisecond on the checks alone.
`decode_ffn` checks once what all four kernels need, then calls ``hc_enter``, ``route_rows``,
``expert_groups`` and ``hc_expand_rows`` (``formats/hc_kernels.cpp``, ``router_kernels.cpp``,
``expert_kernels.cpp``) with the arguments the module path gives them, in its order: the same bits. Where a check
fails or a kernel declines (returns None), it returns None and the module path runs (its kernels are pure:
nothing is lost but the time; a routed expert found quantised after routing has been fetched, so an expert
cache counts that fetch too).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from kvdiet.model import gemv
from kvdiet.model.hc import entry_kernels, sublayer_weights
from kvdiet.model.member import member
from kvdiet.model.moe import Gate, MoE

__all__ = ["decode_ffn"]


def decode_ffn(
    block: nn.Module, h: torch.Tensor, attn_pre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Block.ffn_half` of a decode step's rows through the compiled kernels alone, or None where it does not
    apply.

    Args:
        block: a `kvdiet.model.block.Block`.
        h: the streams fp32 [B, hc, hidden] on the CPU, B = 1..16 (one row per request); attn_pre: the attention
            sublayer's pre-mix fp32 [B, hc].
    Returns:
        ``(new streams fp32 [B, hc, hidden], this FFN's pre [B, hc])``, the bits of the module path; None with
        autograd on, other shapes, dtypes or devices, no compiled kernels, a hash-routed gate, 16 or more experts
        per token, experts not stored dense (a quantised shared expert before any kernel runs; a routed one after
        routing, its experts fetched), ``ffn`` or its gate not exactly `MoE` / `Gate` or given a forward hook or
        an instance ``forward`` (the module path runs them), or a kernel that declines (a NaN in its output
        among them).
    """
    if torch.is_grad_enabled() or h.dim() != 3 or not 1 <= h.shape[0] <= gemv.ROWS_MAX:
        return None
    if h.dtype != torch.float32 or not h.is_cpu:
        return None
    moe = block._modules["ffn"]
    gate = moe._modules.get("gate")
    # the module path calls ``moe`` and its gate: another module there, a subclass or a forward set on the
    # instance runs its own code, and a hook runs
    if type(moe) is not MoE or type(gate) is not Gate or _overridden(moe) or _overridden(gate):
        return None
    shared = moe._modules["shared_experts"]
    # quantised experts (the released checkpoint's) never run here: decline before any kernel runs or any
    # expert is fetched (the module path would do both again)
    if shared.dense_weights() is None:
        return None
    kernels, mix = entry_kernels()
    if kernels is None or mix is None:
        return None
    gate_weight, gate_bias = member(gate, "weight"), member(gate, "bias")
    if member(gate, "tid2eid") is not None or gate_bias is None or not 1 <= gate.topk < 16:
        return None
    cfg, norm = block.cfg, block._modules["ffn_norm"]
    hc = sublayer_weights(block, cfg, h, "ffn")
    if hc.dtype != torch.float32:
        return None
    entered = kernels.hc_enter(
        h, hc.fn_t, hc.scale, hc.base, attn_pre, member(norm, "weight"), norm.eps, cfg.rms_norm_eps, cfg.hc_eps,
        cfg.hc_sinkhorn_iters, mix, any_rows=False,
    )  # fmt: skip
    if entered is None:
        return None
    x, pre, post, comb = entered
    if not gemv.applies(x, gate_weight):  # the gate's own condition for its kernel
        return None
    routed = kernels.route_rows(
        x, gate_weight, gate_bias, gate.topk, gate.norm_topk_prob, gate.routed_scaling_factor
    )
    if routed is None:
        return None
    weights, ids = routed
    # the experts named, fetched in the module path's order (one row: `MoE._one_row`'s routing order; more:
    # `MoE._routed_grouped`'s increasing ids), so an expert cache sees the same reads; then increasing, its
    # ``used`` (each row names an expert at most once, so at most 16 pairs each: decode rows)
    rows = ids.tolist()
    named = rows[0] if len(rows) == 1 else sorted({e for row in rows for e in row})
    by_id = dict(zip(named, moe.fetch(named), strict=True))
    used = sorted(by_id)
    group = [*(by_id[e] for e in used), shared]
    dense = [expert.dense_weights() for expert in group]
    if None in dense:
        return None
    w1s, w3s, w2s = map(list, zip(*dense, strict=True))
    out = kernels.expert_groups(x, ids, weights, used, w1s, w3s, w2s, [e.swiglu_limit for e in group])
    if out is None:
        return None
    streams = kernels.hc_expand_rows(out, h, post, comb, any_rows=True, chain=False)
    return None if streams is None else (streams, pre)


def _overridden(module: nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's ``forward``: a ``forward`` set on the instance,
    or a forward hook (its own, or one registered for every module)."""
    return bool(
        "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )
