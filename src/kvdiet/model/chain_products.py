"""Small batched products with ``torch.bmm``'s bits, compiled: ``chain_bmm`` (``formats/chain_kernels.cpp``) once
it has matched ``torch.bmm`` at a shape class on this machine.

A prefill's mHC mixes streams by ``bmm(combᵀ, residual)`` ([T, 4, 4] x [T, 4, hidden]) and its attention scores
keys by ``bmm(q, windowᵀ)`` and ``bmm(q, selectedᵀ)`` and sums values by ``bmm(probs, window)`` and ``bmm(probs,
selected)`` ([T, H, 8] and [T, H, 4] operands): a few hundred thousand multiply-adds each, which torch's batched
BLAS call spends 21-24 µs on (one thread; this kernel 13-19 µs; the scores at head dim 64 about 100 µs, this
kernel 38 µs). MKL's sgemm sums each output as one FMA chain from +0 in increasing k (found by experiment; the
order is not documented, and torch's own loop below 400 multiply-adds a matrix rounds each product instead), which
the kernel repeats. On an AMD EPYC, where MKL takes its Zen code path, the same chains end with +0 added (a chain
whose products all underflow gives +0 there where the FMA chain alone gives −0; every other output the same bits):
the kernel's second form (`ChainForm.SETTLED`); one batch of 1-long chains there is the product rounded alone, −0
kept: the chain from −0 (`ChainForm.FROM_NEGATIVE_ZERO`). Which form, if any, gives ``torch.bmm``'s bits at a shape
is checked here once per process and shape class (one batch, or more), before the kernel is used there; none keeps
``torch.bmm`` (logged at INFO: the same values, only slower; MKL's small-product order differs at some shapes, e.g.
1 or 2 rows of q against keys, and on the Zen code path q · keysᵀ, the batch-lane classes).

A decode step's mHC entry multiplies its rows by the coefficients' weights (``mm(flatten(h), fn_t)``, [B, 1024] ·
[1024, 24] on v4.1-mini): MKL in the strict reproducible mode kvdiet asks for (`kvdiet.threads`) spends some
6.5 µs on one row of it (the router's ``mm(x, weightᵀ)`` is of the same form, some 0.8 µs of it a call: left to
``torch.mm``). ``chain_mm`` repeats MKL's order, found by experiment on an Intel Xeon: FMA chains from +0 over
blocks of `MKL_BLOCK` values of k, added in order (a K of one to two blocks splits in halves). `product_fits`
says, once per process and shape class, whether that gives ``torch.mm``'s bits here. It knows nothing of the
callers' formulas.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TypeVar

import torch

from kvdiet.formats import native

__all__ = [
    "CHAIN_DEPTH_MAX",
    "CHAIN_MM_ROWS",
    "FOUR_LANES",
    "MKL_BLOCK",
    "TORCH_LOOP_BELOW",
    "ChainForm",
    "batched_product",
    "chain_agrees",
    "chain_class",
    "chain_fits",
    "product_block",
    "product_fits",
    "weight_block",
]

CHAIN_DEPTH_MAX = 64
"""The longest contraction ``chain_bmm`` takes (``kChainDepthMax``)."""

TORCH_LOOP_BELOW = 400
"""Multiply-adds a matrix (M·K·N) below which ``torch.bmm`` on the CPU sums with its own loop of rounded products
instead of its BLAS (ATen's ``bmm_out_or_baddbmm_``; the tests hold torch to it): `batched_product` leaves such
shapes to ``torch.bmm`` without a check or a warning."""


CHAIN_MM_ROWS = 16
"""The most rows of ``a`` ``chain_mm`` takes (``kChainMmRows``: a batched decode step's)."""

MKL_BLOCK = 384
"""Values of k whose products MKL's sgemm sums as one FMA chain in its strict reproducible mode on an Intel Xeon
(AVX-512), the chains then added in order: found by experiment on [M, K] · [K, N] products, M 1..16, K 1..16,384,
N 1..40 (undocumented; `product_block` checks it before ``chain_mm`` stands in)."""

FOUR_LANES = -4
"""``chain_mm``'s block for the four-lane form: each product rounded, then added to its lane's sum (k = 0 and then
k = 1, 5, 9, … to lane 0, k = 2, 6, … to lane 1, and so on up to k = 4q, each lane from +0 in increasing k), the
lanes summed as (0 + 2) + (1 + 3), then the last (K − 1) mod 4 products added in order. MKL's order for one row
by a transposed weight ([1, K] · [K, N], k contiguous in both) on an AMD EPYC (Zen 4; oneMKL 2024.0 in its strict
mode, where it takes a generic code path of 4-float vectors): found by experiment (cancelling ±2³⁰ pairs placed to
reveal which products meet first, then random operands at K 1..4,096 and N a multiple of 4; it held at every
alignment of either operand; other N took another order for their last outputs, which the check finds).
`product_block` checks it before ``chain_mm`` stands in."""


class ChainForm(enum.IntEnum):
    """Which form of ``chain_bmm`` gives ``torch.bmm``'s bits at a shape class (`chain_agrees`); false only for
    `NONE`."""

    NONE = 0
    """Neither: ``torch.bmm`` runs."""
    CHAIN = 1
    """The FMA chain from +0 (``chain_bmm(a, w)``): MKL's order on Intel CPUs."""
    SETTLED = 2
    """The chain, then +0 added to each output (``chain_bmm(a, w, settle_zero=True)``: −0 reads +0): MKL's Zen
    code path."""
    FROM_NEGATIVE_ZERO = 3
    """The chain from −0 (``chain_bmm(a, w, start_negative=True)``: its first step is the first product rounded
    alone, −0 kept): MKL's Zen code path on 1-long chains ([B, 4, 1] · [B, 1, 512] on an AMD EPYC)."""

    @property
    def kernel_flags(self) -> dict[str, bool]:
        """The keyword arguments of ``chain_bmm`` (and ``hc_expand_rows``) that select this form."""
        return {
            "settle_zero": self is ChainForm.SETTLED,
            "start_negative": self is ChainForm.FROM_NEGATIVE_ZERO,
        }


_BATCHES = (3, 16, 17, 256)  # a class of more than one batch; one batch is a class of its own
_CHECK_ELEMENTS = 1 << 22  # a check's batch counts past this many multiply-adds are skipped
_log = logging.getLogger(__name__)
_T = TypeVar("_T")


def chain_class(a: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, bool, bool]:
    """The shape class of ``bmm(a, w)`` (a [B, M, K], w [B, K, N]) that `chain_agrees` checks: (M, K, N, whether
    ``a``'s columns are its contiguous dim, whether ``w``'s are)."""
    return (
        a.shape[1],
        a.shape[2],
        w.shape[2],
        a.stride(1) == 1 and a.stride(2) != 1,
        w.stride(1) == 1 and w.stride(2) != 1,
    )


def chain_fits(m: int, depth: int, n: int, a_cols: bool, w_cols: bool, *, single: bool = False) -> ChainForm:
    """In which form ``chain_bmm`` may stand in for ``torch.bmm`` at this shape class (see `chain_class`) of fp32
    CPU operands without autograd, for a caller that holds the kernels (``native.fp4_kernels()`` not None):
    `ChainForm.NONE` unless 1 ≤ depth ≤ `CHAIN_DEPTH_MAX` and at least `TORCH_LOOP_BELOW` multiply-adds a matrix,
    else `chain_agrees`'s form (checked once per class, batch of one or more, torch matmul precision and intra-op
    thread count). ``single``: the product has one batch (MKL may sum it otherwise; see `chain_agrees`).

    `ChainForm.NONE` too where torch cannot name one fp32 matmul precision (after the per-backend
    ``torch.backends.*.fp32_precision`` settings, ``torch.get_float32_matmul_precision`` raises): the products are
    then torch's own.

    Raises:
        RuntimeError: the kernels are switched off or did not build (from `chain_agrees`'s first check).
    """
    if not 1 <= depth <= CHAIN_DEPTH_MAX or m * depth * n < TORCH_LOOP_BELOW:
        return ChainForm.NONE
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # per-backend precisions set: no one precision to check the chain under
        return ChainForm.NONE
    return chain_agrees(m, depth, n, a_cols, w_cols, precision, torch.get_num_threads(), single=single)


def batched_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, w)`` bit for bit: a fp32 [B, M, K], w fp32 [B, K, N] (any strides) -> fp32 [B, M, N]
    (contiguous). The compiled chain runs where it applies (CPU fp32, no autograd, 1 ≤ K ≤ `CHAIN_DEPTH_MAX`, the
    kernels built and not switched off, at least `TORCH_LOOP_BELOW` multiply-adds a matrix, the shape class
    checked by `chain_agrees`, in the form it found; no NaN in the output); ``torch.bmm`` everywhere else.

    Raises:
        RuntimeError: what ``torch.bmm`` raises for operands it does not take.
    """
    if (
        not torch.is_grad_enabled()
        and a.dim() == w.dim() == 3
        and a.dtype == w.dtype == torch.float32
        and a.is_cpu
        and w.is_cpu
        and (kernels := native.fp4_kernels()) is not None
        and (form := chain_fits(*chain_class(a, w), single=a.shape[0] == 1))
    ):
        out = kernels.chain_bmm(a, w, **form.kernel_flags)
        if out is not None:
            return out
    return torch.bmm(a, w)


@functools.cache
def chain_agrees(
    m: int,
    depth: int,
    n: int,
    a_cols: bool,
    w_cols: bool,
    precision: str,
    threads: int,
    *,
    single: bool = False,
) -> ChainForm:
    """Which form of ``chain_bmm`` gives ``torch.bmm``'s bits at this shape class (see `chain_class`) on this machine
    under torch's fp32 matmul ``precision`` (``torch.get_float32_matmul_precision()``, which may route products
    elsewhere) and on ``threads`` intra-op threads (``torch.get_num_threads()``: MKL splits some shapes by thread count,
    e.g. [1, 5, 6] · [1, 6, 64] on an AMD EPYC), checked once per process and key: `ChainForm.CHAIN`, else
    `ChainForm.SETTLED`, else `ChainForm.FROM_NEGATIVE_ZERO`, where every check holds.

    The checks: batch counts 3, 16, 17 and 256 (3 always, the others within 2^22 multiply-adds), or 1 where
    ``single`` (one batch is a class of its own: MKL may sum it otherwise, e.g. [B, 4, 1] · [B, 1, 512] on an AMD
    EPYC, the rounded product at one batch and the settled chain at more); random operands and adversarial ones (±0,
    subnormals, values where a chain and rounded products differ, products that cancel, chains whose products all
    underflow or are all −0, ±inf; no NaN: the kernel declines NaN outputs), fp32 on the CPU whatever torch's default
    dtype and device. No form (logged at INFO), or no check that ran (the kernel declined them all: at DEBUG), gives
    `ChainForm.NONE`: the caller keeps ``torch.bmm``.

    Raises:
        RuntimeError: the kernels are switched off or did not build.
        ValueError: ``precision`` or ``threads`` is not torch's at this moment (the check runs under torch's).
    """
    kernels = _checking_kernels(precision, threads)
    shape = (m, depth, n, a_cols, w_cols)
    batches = (1,) if single else _BATCHES
    forms = {
        form.name.lower(): form for form in (ChainForm.CHAIN, ChainForm.SETTLED, ChainForm.FROM_NEGATIVE_ZERO)
    }
    with torch.device("cpu"):  # the operands are made under torch's defaults: fp32 on the CPU here
        checks = [
            (f"batch {batch}, case {case}", a, w) for batch, case, a, w in _check_operands(shape, batches)
        ]
    # a kernel that declines every check (e.g. fewer than 16 batches of q · keysᵀ) leaves nothing to tell apart
    form = _first_agreeing(
        forms,
        checks,
        lambda a, w, form: kernels.chain_bmm(a, w, **form.kernel_flags),
        torch.bmm,
        "chain_bmm",
        shape,
    )
    return ChainForm.NONE if form is None else form


def product_fits(m: int, depth: int, n: int, a_cols: bool, w_cols: bool) -> int:
    """The block length with which ``chain_mm`` may stand in for ``torch.mm`` on fp32 CPU operands a [m, depth] · w
    [depth, n] without autograd (``a_cols`` / ``w_cols``: whether that operand's columns are its contiguous dim, a
    transposed weight's), for a caller that holds the kernels: 0 (keep ``torch.mm``) unless 1 ≤ m ≤
    `CHAIN_MM_ROWS` and torch names one fp32 matmul precision, else `product_block`'s (checked once per class,
    matmul precision and intra-op thread count).

    Raises:
        RuntimeError: the kernels are switched off or did not build (from `product_block`'s first check).
    """
    if not 1 <= m <= CHAIN_MM_ROWS or depth < 1 or n < 1:
        return 0
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # per-backend precisions set: no one precision to check the chains under
        return 0
    return product_block(m, depth, n, a_cols, w_cols, precision, torch.get_num_threads())


def weight_block(rows: int | None, weight_t: torch.Tensor) -> int:
    """`product_fits` of contiguous rows a [rows, K] times ``weight_t`` [K, N] (a transposed weight's view, or any
    other layout); ``rows`` None: every count of 2..`CHAIN_MM_ROWS` rows alike (the block all of them found, else 0),
    what a decode step's binding holds for more than one request."""
    depth, n = weight_t.shape
    cols = weight_t.stride(0) == 1 and weight_t.stride(1) != 1
    if rows is not None:
        return product_fits(rows, depth, n, False, cols)
    blocks = {product_fits(m, depth, n, False, cols) for m in range(2, CHAIN_MM_ROWS + 1)}
    return blocks.pop() if len(blocks) == 1 else 0


@functools.cache
def product_block(
    m: int, depth: int, n: int, a_cols: bool, w_cols: bool, precision: str, threads: int
) -> int:
    """The block length with which ``chain_mm`` gives ``torch.mm``'s bits at this shape class on this machine
    (`product_fits`' arguments; ``precision`` and ``threads`` as `chain_agrees` takes them), checked once per
    process and key: `MKL_BLOCK`, else one chain over all of k (``depth``), else `FOUR_LANES`, where every check
    holds; else 0 (logged at INFO: ``torch.mm`` keeps its work, the same values). The checks are `chain_agrees`'
    five cases of random and adversarial operands in this layout (no NaN: the kernel declines NaN outputs); none
    that ran (a build without AVX-512 declines them all: at DEBUG) gives 0 too.

    Raises:
        RuntimeError: the kernels are switched off or did not build.
        ValueError: ``precision`` or ``threads`` is not torch's at this moment (the check runs under torch's).
    """
    kernels = _checking_kernels(precision, threads)
    shape = (m, depth, n, a_cols, w_cols)
    blocks = {f"blocks of {MKL_BLOCK}": MKL_BLOCK}
    if depth > MKL_BLOCK:  # up to MKL_BLOCK values of k, one chain is those blocks
        blocks["one chain"] = depth
    blocks["four lanes"] = FOUR_LANES
    with torch.device("cpu"):
        checks = [(f"case {case}", a[0], w[0]) for _, case, a, w in _check_operands(shape, (1,))]
    block = _first_agreeing(blocks, checks, kernels.chain_mm, torch.mm, "chain_mm", shape)
    return 0 if block is None else block


def _first_agreeing(
    candidates: dict[str, _T],
    checks: list[tuple[str, torch.Tensor, torch.Tensor]],
    kernel: Callable[[torch.Tensor, torch.Tensor, _T], torch.Tensor | None],
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    name: str,
    shape: tuple[int, int, int, bool, bool],
) -> _T | None:
    """The first of ``candidates`` (``{its name in the log: its value}``, in order) for which ``kernel(a, w,
    candidate)`` gives ``reference(a, w)``'s bits on every check ``(label, a, w)`` the kernel takes for it, else
    None. A check a candidate declines (None: a NaN output, or operands it does not take) is left to the
    reference for that candidate, the others still compared on it; a candidate that ran no check is never taken,
    and none that ran (logged at DEBUG) gives None too, and so does every candidate failing a check (logged at
    INFO with each one's first failing check: the reference keeps its work, the same values). ``name`` and
    ``shape`` name the kernel and the class in the log."""
    failed: dict[str, str] = {}  # each candidate's first failing check
    compared = dict.fromkeys(candidates, 0)  # the checks each candidate ran and matched
    for label, a, w in checks:
        want = None
        for key, candidate in candidates.items():
            if key in failed:
                continue
            with torch.inference_mode():
                got = kernel(a, w, candidate)
                if got is None:
                    continue  # declined: this check is the reference's alone for this candidate
                if want is None:
                    want = reference(a, w)
            if got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)):
                compared[key] += 1
            else:
                failed[key] = label
        if len(failed) == len(candidates):
            break
    ref = reference.__name__
    if not any(compared.values()) and not failed:
        _log.debug("compiled %s declined every check at %s; using torch.%s", name, shape, ref)
        return None
    for key, candidate in candidates.items():
        if key not in failed and compared[key]:
            _log.debug("compiled %s (%s) gives torch.%s's bits at %s", name, key, ref, shape)
            return candidate
    first = "; ".join(f"{key}: {label}" for key, label in failed.items())
    _log.info("compiled %s differs from torch.%s at %s (%s); using torch.%s", name, ref, shape, first, ref)
    return None


def _checking_kernels(precision: str, threads: int) -> ModuleType:
    """The compiled kernels, for a check under torch's ``precision`` and ``threads`` at this moment.

    Raises:
        RuntimeError: the kernels are switched off or did not build.
        ValueError: ``precision`` or ``threads`` is not torch's now.
    """
    kernels = native.fp4_kernels()
    if kernels is None:
        raise RuntimeError("kvdiet's compiled kernels are switched off or did not build")
    if precision != torch.get_float32_matmul_precision():
        raise ValueError(
            f"checking under precision {precision!r} while torch's is {torch.get_float32_matmul_precision()!r}"
        )
    if threads != torch.get_num_threads():
        raise ValueError(f"checking on {threads} threads while torch runs {torch.get_num_threads()}")
    return kernels


def _check_operands(
    shape: tuple[int, int, int, bool, bool], batches: tuple[int, ...]
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(batch count, case, a, w) of `chain_agrees`'s checks at ``shape`` (its arguments) and ``batches`` (the first
    always, the others within `_CHECK_ELEMENTS`), from a fixed seed."""
    m, depth, n, a_cols, w_cols = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    for batch in batches:
        if batch != batches[0] and batch * m * depth * n > _CHECK_ELEMENTS:
            return
        for case in range(5):
            a, w = _operand((batch, m, depth), gen, case), _operand((batch, depth, n), gen, case)
            if case == 2 and depth > 1:  # w's rows constant along n, its last 1: a's last k cancels the rest
                w = w[:, :, :1].expand(batch, depth, n).contiguous()
                w[:, -1] = 1
                a[:, :, -1] = -(a[:, :, :-1] * w[:, None, :-1, 0]).sum(-1)
            a, w = _layout(a, transpose=a_cols), _layout(w, transpose=w_cols)
            if case == 3:  # every product −0: the sum from +0 stays +0
                a, w = a.abs(), w.abs().neg().mul(0.0)
            if case == 4:  # every product nonzero but below half the least subnormal: each rounds to ±0 alone
                a, w = a * 2.0**-80, w * 2.0**-80
            yield batch, case, a, w


def _operand(shape: tuple[int, int, int], gen: torch.Generator, case: int) -> torch.Tensor:
    """fp32 ``shape``: cases 0, 2 and 4 normal values (`_check_operands` makes case 2's cancel and scales case
    4's down); 1 and 3 a mix of ±0, subnormals, short-mantissa values (exact products whose sums round on ties),
    values near 1 (cancellation) and scales up to 2^60 (overflow to ±inf)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if case in (0, 2, 4):
        return x
    kind = torch.randint(0, 8, shape, generator=gen)
    short = torch.randint(-64, 64, shape, generator=gen).float() * 0.5
    near_one = 1 + torch.randint(0, 1 << 20, shape, generator=gen).float() * 2.0**-23
    zeros = torch.zeros(shape, dtype=torch.float32)
    x = torch.where(kind == 0, zeros, x)
    x = torch.where(kind == 1, -zeros, x)
    x = torch.where(kind == 2, x * 2.0**-130, x)
    x = torch.where(kind == 3, short, x)
    x = torch.where(kind == 4, near_one * torch.sign(x), x)
    return torch.where(kind == 5, x * 2.0**60, x)


def _layout(x: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """``x`` [B, R, C] with its columns contiguous (a transposed copy) or its rows padded (a slice)."""
    if transpose:
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    padded = torch.zeros(*x.shape[:2], x.shape[2] + 3, dtype=x.dtype)
    padded[..., : x.shape[2]] = x
    return padded[..., : x.shape[2]]
