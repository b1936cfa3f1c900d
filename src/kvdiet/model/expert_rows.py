"""`run_experts`: a group of experts' rows through the compiled ``expert_rows`` or the gemv products, with each
`kvdiet.model.moe.Expert`'s own bits (``formats/expert_kernels.cpp``, `kvdiet.model.gemv.row_products_each`).

It knows nothing of routing: the caller (`kvdiet.model.moe.MoE`) picks the experts, groups the rows and weighs
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.layers import widen

if TYPE_CHECKING:
    from kvdiet.model.moe import Expert

__all__ = ["run_experts"]


def _fits(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``expert_rows`` takes routing weights ``weight`` for rows ``x`` as they are: fp32 [M, 1] on the CPU
    (other dtypes or shapes would promote or broadcast differently in torch's ``weight * act``)."""
    return weight.dtype == torch.float32 and weight.is_cpu and tuple(weight.shape) == (x.shape[0], 1)


def run_experts(
    experts: Sequence[Expert], xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``experts[i](xs[i], weights[i])`` for every i, bit for bit, when every expert is dense and the rows fit
    (`gemv.applies`): a decode step's few rows per expert in one compiled call (``expert_rows``: the
    products of `kvdiet.model.gemv.row_products_each`, the activation as torch's own ops called from C++), or,
    without the compiled kernels or for routing weights of another dtype or shape, two calls of
    `gemv.row_products_each` (every w1 and w3, then every w2) around `Expert.activation`. Otherwise (or when a
    routing weight requires grad under grad mode: the products keep no autograd graph) each expert's own
    forward.

    xs[i]: [N_i, hidden]; weights[i]: [N_i, 1] or None -> [N_i, hidden] each.
    """
    xs = [widen(x) for x in xs]
    dense = [e.dense_weights() for e in experts]
    fit = all(d is not None and gemv.applies_all(x, d) for d, x in zip(dense, xs, strict=True))
    tracked = torch.is_grad_enabled() and any(w is not None and w.requires_grad for w in weights)
    if not fit or tracked:  # the products keep no autograd graph: a routing weight's gradient needs F.linear
        return [e(x, w) for e, x, w in zip(experts, xs, weights, strict=True)]
    kernels = native.fp4_kernels()
    if kernels is not None and all(w is None or _fits(w, x) for w, x in zip(weights, xs, strict=True)):
        return kernels.expert_rows(
            xs, *([d[j] for d in dense] for j in range(3)), list(weights), [e.swiglu_limit for e in experts]
        )
    gate_up = gemv.row_products_each(
        [x for x in xs for _ in range(2)], [w for d in dense for w in d[:2]], checked=False
    )
    acts = [
        e.activation(gate_up[2 * i], gate_up[2 * i + 1], w)
        for i, (e, w) in enumerate(zip(experts, weights, strict=True))
    ]
    return gemv.row_products_each(acts, [d[2] for d in dense], checked=False)
