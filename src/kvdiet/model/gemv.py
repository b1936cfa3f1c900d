"""Decode rows' ``x · Wᵀ`` in one fixed fp32 order, read at the machine's bandwidth.

A decode step multiplies one row (one per request in a batched step) by every weight of the model once. On
the CPU torch's BLAS runs such products at 12-18 GB/s — v4.1-mini's 132 MB LM head takes 10.5 ms on 2 cores,
against some 4 ms at the read bandwidth — and ran 35% of a 4K-context decode step. `row_products` runs them in
the compiled kernel ``row_products`` (``formats/gemv_kernels.cpp``): each weight row read once, 4 rows at a
time, against the input rows 4 at a time, on torch's intra-op threads.

The order (each output one dot product over K inputs):

- 16 lanes: lane l sums ``x[i]·w[i]`` for i = l, l+16, … in increasing i, from +0 (each product rounded,
  then added; no fused multiply-add); past K the lanes read zeros.
- The lanes fold as (l, l+8), then (l, l+4), then (l, l+2), then (0, 1).

The pure-torch path (``KVDIET_NATIVE_KERNELS=0`` or a failed build) computes the same order with whole-tensor
ops and gives the same bits. The order is kvdiet's own: it rounds differently from the BLAS, as the BLAS's
one-row and many-row products already do from each other (a prefill row and the same row decoded were never
bit-equal), within fp32 rounding of the same sum. Off the CPU (cuBLAS), for fp64 weights and for more than
`ROWS_MAX` rows, `linear` is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvdiet.formats import native

__all__ = ["LANES", "ROWS_MAX", "linear", "row_products"]

LANES = 16
"""Partial sums of one dot product (one 16-float vector on AVX-512)."""
ROWS_MAX = 16
"""The most input rows `linear` sends to `row_products` (a batched decode step of up to 16 requests; beyond,
the BLAS's many-row kernel is the faster one)."""
# Elements of the pure-torch path's [M, N, LANES] partial sums per pass (64 MiB as fp32).
_TORCH_BUDGET = 1 << 24


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ``: `row_products` for a few fp32 rows on the CPU, else ``F.linear``.

    Args:
        x: [..., K], weight's dtype.
        weight: [N, K].
    Returns:
        [..., N] in weight's dtype.
    """
    rows = x.reshape(-1, x.shape[-1])
    if (
        0 < rows.shape[0] <= ROWS_MAX
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and weight.is_contiguous()
    ):
        return row_products(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ`` of 1..`ROWS_MAX` rows in the order of the module docstring.

    Args:
        x: fp32 [M, K], on the CPU.
        weight: fp32 [N, K], contiguous, on the CPU.
    Returns:
        fp32 [M, N].
    Raises:
        ValueError: not 1..ROWS_MAX rows, mismatched K, a dtype other than fp32, a non-CPU tensor.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"row_products takes x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= ROWS_MAX:
        raise ValueError(f"row_products takes 1..{ROWS_MAX} rows, got {x.shape[0]}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"row_products takes fp32 tensors, got {x.dtype} and {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("row_products runs on the CPU")
    kernels = native.fp4_kernels()
    if kernels is None:
        return _torch_row_products(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0])
    kernels.row_products(x.contiguous(), weight.contiguous(), out)
    return out


def _torch_row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`row_products` with whole-tensor ops, in the same order: the lanes' sums chunk by chunk, then the fold."""
    m, k = x.shape
    pad = -k % LANES
    xs = F.pad(x, (0, pad)).view(m, 1, -1, LANES)
    ws = F.pad(weight, (0, pad)).view(1, weight.shape[0], -1, LANES)
    out = torch.empty(m, weight.shape[0])
    step = max(1, _TORCH_BUDGET // (m * LANES))
    for start in range(0, weight.shape[0], step):
        w = ws[:, start : start + step]
        acc = torch.zeros(m, w.shape[1], LANES)
        for c in range(xs.shape[2]):
            acc = acc + xs[:, :, c] * w[:, :, c]
        half = acc[..., :8] + acc[..., 8:]
        half = half[..., :4] + half[..., 4:]
        half = half[..., :2] + half[..., 2:]
        out[:, start : start + step] = half[..., 0] + half[..., 1]
    return out
