"""Decode rows' ``x · Wᵀ`` in one fixed fp32 order, read at the machine's bandwidth.

A decode step multiplies one row (one per request in a batched step) by every weight of the model once. On
the CPU torch's BLAS runs such products at 12-18 GB/s — v4.1-mini's 132 MB LM head takes 10.5 ms on 2 cores,
against some 4 ms at the read bandwidth — and ran 35% of a 4K-context decode step. `row_products` runs them in
the compiled kernel ``row_products`` (``formats/gemv_kernels.cpp``): each weight row read once, 4 rows at a
time against the input rows 4 at a time (16 at a time against a single input row), on torch's intra-op
threads.

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

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvdiet.formats import native

__all__ = [
    "LANES",
    "ROWS_MAX",
    "applies",
    "applies_all",
    "lane_dots",
    "linear",
    "row_products",
    "row_products_each",
]

LANES = 16
"""Partial sums of one dot product (one 16-float vector on AVX-512)."""
ROWS_MAX = 16
"""The most input rows `linear` sends to `row_products` (a batched decode step of up to 16 requests; more rows
are a prefill's, left to the BLAS's many-row kernel; the compiled kernel takes no more)."""
_F32 = torch.float32
# Elements of the pure-torch path's [M, N, LANES] partial sums per pass (64 MiB as fp32).
_TORCH_BUDGET = 1 << 24


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs ``x`` [..., K] · ``weight`` [N, K] in `row_products`: 1..`ROWS_MAX` rows, fp32,
    on the CPU, a contiguous weight, no gradient to track."""
    grad = torch.is_grad_enabled()
    return _rows_fit(x, grad) and _weight_fits(weight, grad)


def applies_all(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """`applies` of ``x`` with every one of ``weights`` (``x`` checked once: an MoE layer's w1, w3 and w2 of
    one group of rows)."""
    grad = torch.is_grad_enabled()
    if not _rows_fit(x, grad):
        return False
    return all(_weight_fits(weight, grad) for weight in weights)


def _rows_fit(x: torch.Tensor, grad: bool) -> bool:
    """1..`ROWS_MAX` fp32 CPU rows, no gradient to track (the kernel keeps no autograd graph), not a lazily
    negated view (the kernel reads the storage, which holds −x)."""
    if not (x.is_cpu and x.dtype == _F32 and x.dim()) or (grad and x.requires_grad) or x.is_neg():
        return False
    k = x.shape[-1]
    return 0 < (x.numel() // k if k else 0) <= ROWS_MAX


def _weight_fits(weight: torch.Tensor, grad: bool) -> bool:
    """A contiguous fp32 CPU weight, no gradient to track, not a lazily negated view."""
    return (
        weight.is_cpu
        and weight.dtype == _F32
        and weight.is_contiguous()
        and not (grad and weight.requires_grad)
        and not weight.is_neg()
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ``: `row_products` where it `applies`, else ``F.linear``.

    Args:
        x: [..., K], weight's dtype.
        weight: [N, K].
    Returns:
        [..., N] in weight's dtype.
    """
    if not applies(x, weight):
        return F.linear(x, weight)
    kernels = native.fp4_kernels()
    if kernels is not None:
        return kernels.row_products(x, weight)
    return _torch_row_products(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


def row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ`` of 1..`ROWS_MAX` rows in the order of the module docstring.

    Args:
        x: fp32 [M, K], on the CPU.
        weight: fp32 [N, K], on the CPU.
    Returns:
        fp32 [M, N].
    Raises:
        ValueError: not 1..ROWS_MAX rows, mismatched K, a dtype other than fp32, a non-CPU tensor.
    """
    return row_products_each([x], [weight])[0]


def row_products_each(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], *, checked: bool = True
) -> list[torch.Tensor]:
    """`row_products` of every pair ``(xs[i], weights[i])`` in one call (one parallel region: an MoE layer's
    experts, each pair a few rows and a small weight); the same bits as one call per pair.

    ``checked=False`` skips the checks below (some 1.5 µs a pair, as much as a small product) for a caller
    that established `applies` for every pair and matching K (a decode step's hot path).

    Raises:
        ValueError: as `row_products`, naming the pair; lengths differ.
    """
    if checked:
        _check_pairs(xs, weights)
    kernels = native.fp4_kernels()
    if kernels is None:
        return [_torch_row_products(x, weight) for x, weight in zip(xs, weights, strict=True)]
    outs = [
        torch.empty(x.shape[0], weight.shape[0], dtype=_F32, device="cpu")
        for x, weight in zip(xs, weights, strict=True)
    ]
    kernels.row_products_each([x.contiguous() for x in xs], [w.contiguous() for w in weights], outs)
    return outs


def _check_pairs(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    if len(xs) != len(weights):
        raise ValueError(
            f"row_products_each takes as many inputs as weights, got {len(xs)} and {len(weights)}"
        )
    for i, (x, weight) in enumerate(zip(xs, weights, strict=True)):
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(
                f"row_products takes x [M, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
                f" (pair {i})"
            )
        if not 1 <= x.shape[0] <= ROWS_MAX:
            raise ValueError(f"row_products takes 1..{ROWS_MAX} rows, got {x.shape[0]} (pair {i})")
        if x.dtype != _F32 or weight.dtype != _F32:
            raise ValueError(f"row_products takes fp32 tensors, got {x.dtype} and {weight.dtype} (pair {i})")
        if not (x.is_cpu and weight.is_cpu):
            raise ValueError(f"row_products runs on the CPU (pair {i})")


def _torch_row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`row_products` with whole-tensor ops (`lane_dots` of one batch entry)."""
    return lane_dots(x[None], weight[None])[0]


def lane_dots(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x[b] · weight[b]ᵀ`` for each b in the order of the module docstring, with whole-tensor ops: the lanes'
    sums chunk by chunk, then the fold (`row_products`'s bits for each b).

    Args:
        x: fp32 [B, M, K] on the CPU, any layout.
        weight: fp32 [B, N, K] on the CPU, any layout.
    Returns:
        fp32 [B, M, N].
    """
    b, m, k = x.shape
    n = weight.shape[1]
    pad, chunks = -k % LANES, -(-k // LANES)
    xs = F.pad(x, (0, pad)).reshape(b, m, 1, chunks, LANES)
    ws = F.pad(weight, (0, pad)).reshape(b, 1, n, chunks, LANES)
    out = torch.empty(b, m, n, dtype=_F32, device="cpu")
    step = max(1, _TORCH_BUDGET // max(1, b * m * LANES))  # no rows: one empty pass
    for start in range(0, n, step):
        w = ws[:, :, start : start + step]
        acc = torch.zeros(b, m, w.shape[2], LANES, dtype=_F32, device="cpu")
        for c in range(chunks):
            acc = acc + xs[..., c, :] * w[..., c, :]
        half = acc[..., :8] + acc[..., 8:]
        half = half[..., :4] + half[..., 4:]
        half = half[..., :2] + half[..., 2:]
        out[:, :, start : start + step] = half[..., 0] + half[..., 1]
    return out
