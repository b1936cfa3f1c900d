"""A decode step's attention of one layer in one fixed fp32 order: one compiled call on the CPU.

`kvdiet.model.attention.attend` runs a decode step's softmax over each request's window keys, its selected
compressed entries and the sink as four ``bmm`` and seven other torch ops (140–330 µs per layer at v4.1-mini's
4 heads × 512 dims over 128 + 512 keys, on one or two threads: 10–14% of a 4K-context step). `decode_attend`
computes the same quantity (v41-spec §2: ``o = softmax(q·[window ∪ selected]ᵀ · scale, sink) · [window ∪
selected]``) in the compiled kernel ``attend_rows`` (``formats/attend_kernels.cpp``), in this order:

- logits: each key's score is ``dot(q[b, h], key)`` in `kvdiet.model.gemv`'s order (16 lanes over the head dim,
  then the fold (l, l+8), (l, l+4), (l, l+2), (0, 1); no FMA) — ``row_products(q[b], keys[b])`` — times
  ``scale`` as one fp32 multiply (``attend``'s ``mul_(scale)``); a masked key's logit is −inf; the sink's logit
  is ``sink[h]``, last.
- probabilities: ``torch.softmax`` of the [B, H, W + K + 1] logits (the kernel calls torch's own softmax, on as
  many requests' rows at a time as it has threads: a row's softmax does not depend on the rows beside it).
- output: ``o[b, h, d] = Σ_j p[b, h, j] · key_j[d]`` over the W window keys then the K selected entries as one
  sum in the same order with the keys as the summed index (16 lanes, lane l summing keys l, l + 16, … from +0,
  then the fold) — ``row_products(p[b, :, :W+K], keys[b]ᵀ)``; the sink's value is 0.

The pure-torch path (``KVDIET_NATIVE_KERNELS=0`` or a failed build) computes the same order with whole-tensor
ops (`kvdiet.model.gemv.lane_dots`) and gives the same bits. The order is kvdiet's own: it rounds differently
from ``attend``'s BLAS products (within fp32 rounding of the same sums), so a decode step's attention output is
not bit-equal to a prefill's of the same row, as the BLAS's one-row and many-row products already were not.
Prefill and the no-cache reference keep ``attend``.
"""

from __future__ import annotations

import torch

from kvdiet.formats import native
from kvdiet.model.attention import attend
from kvdiet.model.gemv import lane_dots
from kvdiet.model.layers import as_dtype

__all__ = ["decode_attend"]

_F32 = torch.float32


def decode_attend(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over each request's window keys, selected compressed keys and the sink (value 0), in the
    order of the module docstring.

    Args:
        q: fp32 [B, H, D] queries (one row per request).
        win_kv: fp32 [B, W, D] each request's window keys (= values), any layout; ``win_mask`` bool [B, W].
        comp_kv: fp32 [B, K, D] each request's selected entries, or bf16 (read as their fp32 values: the compiled
            gather's, ``fp4.gather_main_kv``), or None (a layer without compression); ``comp_mask`` bool [B, K],
            None with it. Only read (a Reuse layer shares its source's).
        sink: [H] per-head sink logits (read as fp32).
        scale: softmax scale (head_dim^-½).
    Returns:
        fp32 [B, H, D]: the compiled kernel when it built (fp32 CPU tensors, ``comp_kv`` fp32 or bf16, no
        gradient to track), else the pure-torch path with the same bits. fp64 inputs (a model run in fp64),
        tensors off the CPU (cuBLAS) and inputs with a gradient to track go to ``attend`` (its BLAS order, in
        their dtype; bf16 entries widened to it first).
    Raises:
        ValueError: shapes that do not match as above, masks that are not bool, ``comp_kv`` without
            ``comp_mask`` (or the reverse), q / keys of different or non-floating dtypes (``comp_kv`` may be
            bf16), or tensors on different devices; raised before any work.
    """
    _check(q, win_kv, win_mask, comp_kv, comp_mask, sink)
    inputs = (q, win_kv, sink) if comp_kv is None else (q, win_kv, sink, comp_kv)
    if not (q.is_cpu and q.dtype == _F32) or (
        torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    ):
        comp_kv = None if comp_kv is None else as_dtype(comp_kv, q.dtype)
        return attend(q, win_kv, win_mask, comp_kv, comp_mask, sink, scale)
    sink = as_dtype(sink, _F32)
    kernels = native.fp4_kernels()
    if kernels is None:
        comp_kv = None if comp_kv is None else as_dtype(comp_kv, _F32)  # bf16 → fp32: exact
        return _torch_attend(q, win_kv, win_mask, comp_kv, comp_mask, sink, scale)
    return kernels.attend_rows(q, win_kv, win_mask, comp_kv, comp_mask, sink, scale)


def _check(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    sink: torch.Tensor,
) -> None:
    """Raise ValueError unless the inputs match `decode_attend`'s shapes, dtypes and device."""
    if q.dim() != 3:
        raise ValueError(f"decode_attend takes q [B, H, D], got {tuple(q.shape)}")
    b, h, d = q.shape
    shape = win_kv.shape
    if len(shape) != 3 or shape[0] != b or shape[2] != d:
        raise ValueError(f"decode_attend takes win_kv [{b}, W, {d}], got {tuple(shape)}")
    dtype, device = q.dtype, q.device
    if not dtype.is_floating_point or win_kv.dtype != dtype or not sink.dtype.is_floating_point:
        raise ValueError(
            f"decode_attend takes floating q and sink, win_kv in q's dtype, got {dtype}, {win_kv.dtype},"
            f" {sink.dtype}"
        )
    _check_mask(win_mask, "win_mask", b, shape[1])
    if (comp_kv is None) != (comp_mask is None):
        raise ValueError("decode_attend takes comp_kv and comp_mask together (or neither)")
    if comp_kv is not None:
        shape = comp_kv.shape
        if len(shape) != 3 or shape[0] != b or shape[2] != d:
            raise ValueError(f"decode_attend takes comp_kv [{b}, K, {d}], got {tuple(shape)}")
        if comp_kv.dtype not in (dtype, torch.bfloat16):
            raise ValueError(f"decode_attend takes comp_kv in q's dtype {dtype} or bf16, got {comp_kv.dtype}")
        _check_mask(comp_mask, "comp_mask", b, shape[1])
        if comp_kv.device != device or comp_mask.device != device:
            raise ValueError("decode_attend takes its tensors on one device")
    if sink.shape != (h,):
        raise ValueError(f"decode_attend takes sink [{h}], got {tuple(sink.shape)}")
    if win_kv.device != device or win_mask.device != device or sink.device != device:
        raise ValueError("decode_attend takes its tensors on one device")


def _check_mask(mask: torch.Tensor, name: str, b: int, n: int) -> None:
    if mask.dtype != torch.bool or mask.shape != (b, n):
        raise ValueError(f"decode_attend takes {name} bool [{b}, {n}], got {mask.dtype} {tuple(mask.shape)}")


def _torch_attend(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`decode_attend`'s order with whole-tensor ops (fp32 CPU inputs, ``sink`` fp32): the kernel's bits."""
    b, h, _ = q.shape
    keys = win_kv if comp_kv is None else torch.cat([win_kv, comp_kv], dim=1)  # [B, W + K, D]
    mask = win_mask if comp_mask is None else torch.cat([win_mask, comp_mask], dim=1)
    scores = lane_dots(q, keys).mul_(scale).masked_fill_(~mask[:, None, :], float("-inf"))
    logits = torch.cat([scores, sink[None, :, None].expand(b, h, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return lane_dots(probs[..., : keys.shape[1]], keys.transpose(1, 2))
