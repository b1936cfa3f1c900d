"""The comparisons, as pure functions of tensors: next-token distributions, selections, continuations.

Every measure is 0 / 1 when its two sides are identical (tests hold them to that), and each is taken per row,
then averaged by the caller.
"""

from __future__ import annotations

import torch

__all__ = ["continuation_agreement", "kl_divergence", "max_abs_delta", "set_overlap", "top1_agreement"]


def kl_divergence(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """KL(P‖Q) in nats per row, P = softmax(``exact``), Q = softmax(``approx``); logits [R, V] → fp64 [R].

    Computed in fp64 from log-softmax, so identical rows give exactly 0.
    """
    p = torch.log_softmax(exact.double(), dim=-1)
    q = torch.log_softmax(approx.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).clamp(min=0.0)


def top1_agreement(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """1.0 where both rows' argmax is the same token, else 0.0: logits [R, V] → fp64 [R]."""
    return (exact.argmax(-1) == approx.argmax(-1)).double()


def max_abs_delta(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """max |Δlogit| per row: [R, V] → fp64 [R]."""
    return (exact.double() - approx.double()).abs().amax(-1)


def set_overlap(
    a: torch.Tensor, a_valid: torch.Tensor, b: torch.Tensor, b_valid: torch.Tensor
) -> torch.Tensor:
    """|A ∩ B| / |B| per row, for selections ``a``/``b`` int64 [R, k] with validity bool [R, k] (rows where B is
    empty count 1). fp64 [R]. Order inside a row does not matter.
    """
    out = torch.empty(a.shape[0], dtype=torch.float64)
    for r in range(a.shape[0]):
        sa = set(a[r][a_valid[r]].tolist())
        sb = set(b[r][b_valid[r]].tolist())
        out[r] = len(sa & sb) / len(sb) if sb else 1.0
    return out


def continuation_agreement(a: list[int], b: list[int]) -> float:
    """Share of the first ``len(a)`` greedy tokens that agree before the first difference (prefix length / N)."""
    if len(a) != len(b):
        raise ValueError(f"continuations differ in length: {len(a)} vs {len(b)}")
    if not a:
        return 1.0
    same = 0
    for x, y in zip(a, b, strict=True):
        if x != y:
            break
        same += 1
    return same / len(a)
