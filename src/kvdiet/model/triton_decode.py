"""Sparse decode attention over packed FP4 main KV, in Triton: the selected entries are read as their 288 bytes
straight from the paged device pool, never decoded into an fp32 copy.

What it computes is `kvdiet.model.attention.attend` with ``comp_kv`` the decoded entries
(``fp4_e2m1_e4m3x16``, `kvdiet.formats.fp4`): one softmax over the window keys, the selected compressed keys
(an invalid selection slot masked) and the per-head sink (value 0). The kernel covers the selected entries,
split over ``splits`` programs per query and blocks of 16 heads (flash-decoding): each program streams its
share of the top-k slots for its heads, decodes each byte's two E2M1 nibbles (low nibble = even element, sign
bit 3) and each 16-value block's E4M3 scale in registers, and keeps an online softmax — running max ``m``, sum
``l`` and unnormalised output ``acc`` for every head. `attend_packed` merges those partials with the window
keys and the sink in torch (log-sum-exp), so the result equals ``attend``'s up to fp32 summation order.
Decoded values are exact (an E2M1 value times an E4M3 scale is exact in fp32), as in the torch decode.

Used on CUDA when ``triton`` imports (`available`); the tests run it on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported). It knows the entry layout of the main-KV format
and nothing of requests or pools beyond a rows tensor and row indices.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["attend_packed", "available", "sparse_partials"]

_BLOCK_K = 16  # selected entries per loop step (tl.dot needs ≥ 16)
_BLOCK_H = 16  # heads per program: its two [16, D/2] fp32 accumulators stay in registers


@functools.cache
def available() -> bool:
    """Whether ``triton`` imports (it is in the dev extra; a CPU-only install may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():  # built on first use: importing triton is slow and it may be absent
    import triton
    import triton.language as tl

    @triton.jit
    def fp4_sparse_decode(
        q_ptr,  # fp32 [B, H, D]
        rows_ptr,  # uint8 [N, ENTRY]: the pool's rows of one layer
        slot_ptr,  # int64 [B, K]: pool row of each selected entry
        valid_ptr,  # int8 [B, K]
        m_ptr,  # fp32 [B, S, H]
        l_ptr,  # fp32 [B, S, H]
        acc_ptr,  # fp32 [B, S, H, D]
        num_heads,
        k_total,
        k_per_split,
        scale,
        HALF: tl.constexpr,  # D / 2: bytes of nibbles
        ENTRY: tl.constexpr,  # bytes per entry (9·D/16)
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # head blocks vary fastest: the programs reading the same entries run together (one HBM read, L2 after)
        h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        b = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        d = 2 * HALF
        j = tl.arange(0, HALF)  # byte j holds elements 2j (low nibble) and 2j + 1 (high)
        hmask = h < num_heads
        q_base = q_ptr + b * num_heads * d + h[:, None] * d + 2 * j[None, :]
        q_even = tl.load(q_base, mask=hmask[:, None], other=0.0)  # [BLOCK_H, HALF]
        q_odd = tl.load(q_base + 1, mask=hmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc_even = tl.zeros([BLOCK_H, HALF], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, HALF], tl.float32)
        start = split * k_per_split
        end = tl.minimum(start + k_per_split, k_total)
        for k0 in range(start, end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < end
            slot = tl.load(slot_ptr + b * k_total + kk, mask=kmask, other=0)
            valid = (tl.load(valid_ptr + b * k_total + kk, mask=kmask, other=0) != 0) & kmask
            base = rows_ptr + slot[:, None] * ENTRY
            byte = tl.load(base + j[None, :], mask=valid[:, None], other=0).to(tl.int32)  # [BLOCK_K, HALF]
            sbyte = tl.load(base + HALF + j[None, :] // 8, mask=valid[:, None], other=0x38).to(tl.int32)
            se = (sbyte >> 3) & 15  # E4M3: (8 + m)·2^(e − 10), subnormal m·2^-9
            sm = (sbyte & 7).to(tl.float32)
            s = tl.where(se == 0, sm * 0.001953125, (8.0 + sm) * tl.exp2((se - 10).to(tl.float32)))
            lo = byte & 15
            hi = byte >> 4
            le, lm = ((lo & 7) >> 1), (lo & 1).to(tl.float32)  # E2M1: 0.5·m, else (1 + m/2)·2^(e − 1)
            he, hm = ((hi & 7) >> 1), (hi & 1).to(tl.float32)
            lv = tl.where(le == 0, 0.5 * lm, (1.0 + 0.5 * lm) * tl.exp2((le - 1).to(tl.float32)))
            hv = tl.where(he == 0, 0.5 * hm, (1.0 + 0.5 * hm) * tl.exp2((he - 1).to(tl.float32)))
            v_even = tl.where((lo & 8) != 0, -lv, lv) * s  # [BLOCK_K, HALF]
            v_odd = tl.where((hi & 8) != 0, -hv, hv) * s
            scores = tl.dot(q_even, tl.trans(v_even), input_precision="ieee")
            scores += tl.dot(q_odd, tl.trans(v_odd), input_precision="ieee")  # [BLOCK_H, BLOCK_K]
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision="ieee")
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision="ieee")
            m_i = m_new
        out = (b * num_splits + split) * num_heads + h
        tl.store(m_ptr + out, m_i, mask=hmask)
        tl.store(l_ptr + out, l_i, mask=hmask)
        acc_base = acc_ptr + out[:, None] * d + 2 * j[None, :]
        tl.store(acc_base, acc_even, mask=hmask[:, None])
        tl.store(acc_base + 1, acc_odd, mask=hmask[:, None])

    return fp4_sparse_decode


def sparse_partials(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    *,
    splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax partials of ``q`` over the selected packed entries, ``splits`` programs per query.

    Args:
        q: fp32 [B, H, D] queries (D a multiple of 32).
        rows: uint8 [N, 9·D/16] packed ``fp4_e2m1_e4m3x16`` entries (the pool rows of one layer and kind).
        slots: int64 [B, K] the row of each selected entry (any value where ``valid`` is False).
        valid: bool [B, K].
        scale: softmax scale (head_dim^-½).
        splits: programs per query, each over ⌈K / splits⌉ consecutive slots (≥ 1).
    Returns:
        ``(m fp32 [B, S, H], l fp32 [B, S, H], acc fp32 [B, S, H, D])``: per split the largest scaled score
        (−inf when it saw no valid slot), Σ exp(score − m) and Σ exp(score − m)·value.
    Raises:
        ValueError: shapes, dtypes or devices that do not fit, or ``splits`` < 1.
    """
    b, h, d = q.shape
    if q.dtype != torch.float32 or rows.dtype != torch.uint8 or rows.dim() != 2 or d % 32:
        raise ValueError(
            f"need fp32 q [B, H, D] (D % 32 == 0) and uint8 rows [N, E], got {q.dtype} {rows.dtype}"
        )
    if rows.shape[1] != 9 * d // 16 or slots.shape != valid.shape or slots.shape[0] != b or splits < 1:
        raise ValueError(
            f"rows must be [N, {9 * d // 16}], slots and valid [{b}, K], splits ≥ 1; got rows "
            f"{tuple(rows.shape)}, slots {tuple(slots.shape)}, valid {tuple(valid.shape)}, splits {splits}"
        )
    if len({q.device, rows.device, slots.device, valid.device}) != 1:
        raise ValueError("q, rows, slots and valid must be on one device")
    k = slots.shape[1]
    per_split = max(_BLOCK_K, -(-k // splits))
    splits = max(1, -(-k // per_split))
    m = torch.empty(b, splits, h, device=q.device)
    l_sum = torch.empty(b, splits, h, device=q.device)
    acc = torch.empty(b, splits, h, d, device=q.device)
    _kernel()[(-(-h // _BLOCK_H), b, splits)](
        q.contiguous(),
        rows.contiguous(),
        slots.to(torch.int64).contiguous(),
        valid.to(torch.int8).contiguous(),
        m,
        l_sum,
        acc,
        h,
        k,
        per_split,
        float(scale),
        HALF=d // 2,
        ENTRY=9 * d // 16,
        BLOCK_H=_BLOCK_H,
        BLOCK_K=_BLOCK_K,
    )
    return m, l_sum, acc


def attend_packed(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    splits: int = 1,
) -> torch.Tensor:
    """`kvdiet.model.attention.attend` with the selected entries read packed: fp32 [B, H, D].

    Args:
        q: fp32 [B, H, D]; win_kv fp32 [L, D] shared by the queries, or [B, L, D] each query's own (its window
            band), with win_mask bool [B, L]; sink fp32 [H]; scale as ``attend``.
        rows, slots, valid, splits: the packed selection, as `sparse_partials`.
    Raises:
        ValueError: as `sparse_partials`.
    """
    m, l_sum, acc = sparse_partials(q, rows, slots, valid, scale, splits=splits)
    b, h, _ = q.shape
    shared = win_kv.dim() == 2
    win = (q.reshape(b * h, -1) @ win_kv.T).view(b, h, -1) if shared else torch.bmm(q, win_kv.transpose(1, 2))
    win = win.mul_(scale)
    win = win.masked_fill_(~win_mask[:, None, :], float("-inf"))
    sink = sink.float()[None, :].expand(b, h)
    top = torch.maximum(torch.maximum(win.amax(-1), m.amax(1)), sink)  # [B, H]; the sink is finite
    p_win = torch.exp(win - top[..., None])
    weight = torch.exp(m - top[:, None, :])  # [B, S, H]; 0 for a split with no valid slot
    total = p_win.sum(-1) + (weight * l_sum).sum(1) + torch.exp(sink - top)
    out = (p_win.reshape(b * h, 1, -1) @ win_kv).view(b, h, -1) if shared else torch.bmm(p_win, win_kv)
    out += (weight[..., None] * acc).sum(1)
    return out / total[..., None]
