"""``torch.softmax(x, -1)`` over rows narrower than one AVX-512 vector, in one compiled pass, with torch's bits.

A prefill's attention logits are rows of window + top-k + 1 (sink) floats: 13 on the 40-layer tiny plan, where
torch's CPU softmax runs its under-one-vector reduction a vector store, load and op per element, some 1 ms for
a layer's 1,024 × 4 rows (0.1 ms for rows of 16). ``softmax_rows`` (``formats/softmax_kernels.cpp``) computes
what torch computes there (max, torch's own Sleef exp of x − max, the sum left to right, times 1 / sum) in one
vector pass per row. It runs only after `kernel_agrees` found its bits equal to torch.softmax's on this machine;
any input it declines (NaN, a row of −inf or one with +inf, other dtypes or widths, non-CPU, a build without
AVX-512) and ``KVDIET_NATIVE_KERNELS=0`` run torch.softmax.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvdiet.formats import native

__all__ = ["WIDTH_MAX", "kernel_agrees", "softmax_last"]

WIDTH_MAX = 15
"""The widest row the compiled ``softmax_rows`` takes (the kernel's ``kSoftmaxWidthMax``, under one vector)."""
_log = logging.getLogger(__name__)


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x, -1)``, bit for bit.

    Args:
        x: float tensor [..., n], any device and layout. fp32 contiguous CPU rows of 1 ≤ n ≤ `WIDTH_MAX`, with
            no gradient to track, run in the compiled ``softmax_rows`` once `kernel_agrees`; others, and any the
            kernel declines, in torch.softmax.
    Returns:
        A new tensor of ``x``'s shape and dtype: ``exp(x − max) / Σ exp(x − max)`` per row, as torch computes it.
    """
    if (
        x.dtype == torch.float32
        and x.is_cpu
        and 1 <= x.shape[-1] <= WIDTH_MAX
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
    ):
        kernels = native.fp4_kernels()
        if kernels is not None and kernel_agrees():
            out = kernels.softmax_rows(x)
            if out is not None:
                return out
    return torch.softmax(x, -1)


@functools.cache
def kernel_agrees() -> bool:
    """Whether the compiled ``softmax_rows`` gives torch.softmax's bits on adversarial rows on this machine, checked
    once per process (some 10 ms); a mismatch logs a warning.

    The rows: every width 1..`WIDTH_MAX`, at 1, 3 and 64 rows (a row's bits do not depend on the others); values
    at scales 1e-30..1e30 (exp underflows to subnormals and 0), −inf (masked keys), ±0 and subnormals, and ties.

    Raises:
        RuntimeError: the kernels did not build or are switched off.
    """
    kernels = native.fp4_kernels()
    if kernels is None:
        raise RuntimeError("kvdiet's compiled kernels are switched off or did not build")
    gen = torch.Generator(device="cpu").manual_seed(0)
    specials = torch.tensor([float("-inf"), 0.0, -0.0, 1e-40, -1e-45, 1.0], dtype=torch.float32)
    ran = 0
    with torch.inference_mode():
        for n in range(1, WIDTH_MAX + 1):
            for rows in (1, 3, 64):
                for scale in (1e-30, 1e-3, 1.0, 30.0, 1e4, 1e30):
                    x = torch.randn(rows, n, generator=gen) * scale
                    chosen = torch.rand(rows, n, generator=gen) < 0.3
                    picks = torch.randint(len(specials), (int(chosen.sum()),), generator=gen)
                    x[chosen] = specials[picks]
                    x[:, -1] = torch.randn(rows, generator=gen)  # a finite entry per row, as the sink is
                    got = kernels.softmax_rows(x)
                    if got is None:
                        continue
                    ran += 1
                    if not torch.equal(got.view(torch.int32), torch.softmax(x, -1).view(torch.int32)):
                        _log.warning(
                            "compiled softmax_rows differs from torch.softmax (width %d); using torch's", n
                        )
                        return False
    return ran > 0
