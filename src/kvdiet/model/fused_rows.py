"""A decode step's rows through a group of modules in one compiled call each, with the module path's bits.

On the CPU, for 1..16 fp32 rows with no autograd, dense fp32 weights and no hooked module, the calls here run what
several module calls would (`Linear`, `RMSNorm`, `Rotation.apply`, the MoE's experts): the same kernel and torch
calls in the same order, so the same values bit for bit. Each returns None where it does not apply (or a kernel
declines, e.g. a NaN whose payload torch's own loop decides), and the caller runs the modules. Kernels:
``formats/projection_kernels.cpp`` (``project_rows``, ``project_out_rows``) and ``formats/expert_kernels.cpp``
(``expert_groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.layers import RMSNorm, kernels_agree, rope_kernels
from kvdiet.model.linear import Linear
from kvdiet.model.member import member, overridden

if TYPE_CHECKING:
    from kvdiet.model.layers import Rotation
    from kvdiet.model.moe import Expert

__all__ = ["expert_groups", "fused_kernels", "project_out_rows", "project_rows"]


def fused_kernels(
    x: torch.Tensor, w_a: Linear, w_b: Linear | None, rope_dim: int, norm: RMSNorm | None = None
) -> ModuleType | None:
    """The compiled kernels where a projection of ``x`` through ``w_a`` (``norm``, ``w_b``) that rotates
    ``rope_dim`` dims may run in them: 1..16 fp32 CPU rows, no autograd, dense weights, each module exactly a
    `Linear` / `RMSNorm` with no hook and no ``forward`` of its own (`kvdiet.model.member.overridden`: a
    subclass's or a hook's code runs on the module path), the kernels built and the rotation kernel checked for
    that ``rope_dim`` (`kvdiet.model.layers.rope_kernels`); else None."""
    if (
        torch.is_grad_enabled()
        or x.dtype != torch.float32
        or not x.is_cpu
        or not 1 <= x.shape[0] <= gemv.ROWS_MAX
    ):
        return None
    if overridden(w_a, Linear) or (w_b is not None and overridden(w_b, Linear)):
        return None
    if norm is not None and overridden(norm, RMSNorm):
        return None
    if w_a.storage != "dense" or (w_b is not None and w_b.storage != "dense"):
        return None
    return rope_kernels(rope_dim)


def project_rows(
    x: torch.Tensor, w_a: Linear, norm: RMSNorm, w_b: Linear | None, heads: int, head_dim: int, rot: Rotation
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Attention.project_q` (with ``w_b``: ``(qr [T, R], q [T, heads, head_dim])``) or `project_window_kv`'s
    (and, with one head, `Indexer.keys`') ``(normed, rotated)`` for rows ``x`` fp32 [T, hidden] in one
    ``project_rows`` call; None where it does not apply (see the module docstring; the norm kernel checked too)."""
    kernels = fused_kernels(x, w_a, w_b, rot.rope_dim, norm)
    if kernels is None or x.dim() != 2 or not kernels_agree("rms_norm"):
        return None
    b_weight = None if w_b is None else member(w_b, "weight")
    a_weight, n_weight = member(w_a, "weight"), member(norm, "weight")
    return kernels.project_rows(
        x, a_weight, n_weight, norm.eps, b_weight, heads, head_dim, rot.cis, rot.rope_dim
    )


def project_out_rows(
    o: torch.Tensor, rot: Rotation, wo_a: Linear, wo_b: Linear, groups: int
) -> torch.Tensor | None:
    """`Attention.project_out` of a contiguous ``o`` fp32 [T, H, D] in one ``project_out_rows`` call (the inverse
    rotation, the grouped ``wo_a`` bmm, ``wo_b``) → fp32 [T, hidden]; None where it does not apply."""
    kernels = fused_kernels(o, wo_a, wo_b, rot.rope_dim)
    if kernels is None or not o.is_contiguous():
        return None
    a_weight, b_weight = member(wo_a, "weight"), member(wo_b, "weight")
    return kernels.project_out_rows(o, rot.cis_inverse, rot.rope_dim, a_weight, groups, b_weight)


def expert_groups(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    used: list[int],
    modules: Sequence[Expert],
    shared: Expert,
) -> torch.Tensor | None:
    """`MoE._routed_grouped`'s (and `MoE._one_row`'s) decode rows in one ``expert_groups`` call: the same groups
    through `kvdiet.model.moe.run_experts`'s kernel, the k slots summed by torch's own sum of the same
    [T, k, hidden] tensor, the shared expert added, so the same bits. Rows ``x`` fp32 [T, hidden] name experts
    ``ids`` int64 [T, k] (``used``: the ids named, increasing, at most 16 pairs each; ``modules``: those experts,
    already fetched) with routing ``weights`` fp32 [T, k] on the CPU, k < 16; rows fitting `gemv.applies_all`,
    every used expert and ``shared`` dense, no autograd. Else None (also where an output is NaN, or where a
    weight is not contiguous fp32 on the CPU or is a lazily negated view: the kernel checks those)."""
    k = ids.shape[1]
    if torch.is_grad_enabled() or not 1 <= k < 16 or x.dim() != 2:
        return None
    if weights.dtype != torch.float32 or not weights.is_cpu or weights.shape != ids.shape:
        return None
    group = [*modules, shared]
    dense = [e.dense_weights() for e in group]
    if None in dense or not gemv.applies_all(x, ()):
        return None
    kernels = native.fp4_kernels()
    if kernels is None:
        return None
    w1s, w3s, w2s = map(list, zip(*dense, strict=True))  # no Python frame per list
    return kernels.expert_groups(x, ids, weights, used, w1s, w3s, w2s, [e.swiglu_limit for e in group])
