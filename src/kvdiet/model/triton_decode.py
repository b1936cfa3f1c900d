"""Sparse decode attention over packed FP4 main KV, in Triton: the selected entries are read as their 288 bytes
straight from the paged device pool, never decoded into an fp32 copy.

What it computes is `kvdiet.model.attention.attend` with ``comp_kv`` the decoded entries
(``fp4_e2m1_e4m3x16``, `kvdiet.formats.fp4`): one softmax over the window keys, the selected compressed keys
(an invalid selection slot masked) and the per-head sink (value 0). The kernel covers the selected entries,
split over ``splits`` programs per query and blocks of heads (flash-decoding; `Tile`): each program streams
its share of the top-k slots for its heads, decodes each byte's two E2M1 nibbles (low nibble = even element,
sign bit 3) and each 16-value block's E4M3 scale in registers, and keeps an online softmax — running max
``m``, sum ``l`` and unnormalised output ``acc`` for every head. `attend_packed` merges those partials with the
window keys and the sink in torch (log-sum-exp), so the result equals ``attend``'s up to fp32 summation order.
Decoded values are exact (an E2M1 value times an E4M3 scale has at most 6 significant bits), as in the torch
decode, and exact in fp16, the inputs of the tensor-core dots (`PRECISIONS`).

With 64 heads sharing one 512-d latent, each 288-B entry costs 4·64·512 = 131,072 FLOP (scores and output):
455 FLOP per byte read, over twice an H200's dense bf16 ridge (~990 TFLOP/s ÷ 4.8 TB/s ≈ 206), so this read
is arithmetic-bound at V4.1's head count; ``bench_triton_decode.py`` reports both ceilings.

Used on CUDA when ``triton`` imports (`available`); the tests run it on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported). It knows the entry layout of the main-KV format
and nothing of requests or pools beyond a rows tensor and row indices.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

__all__ = ["DEFAULT_TILE", "PRECISIONS", "Tile", "attend_packed", "available", "sparse_partials"]

PRECISIONS = ("fp16x3", "fp16x2", "ieee")
"""The kernel's dot products. ``fp16x3``: on fp16 tensor cores, with fp32 accumulation; the decoded entries
are exact in fp16, and the fp32 operand is split into three fp16 terms that sum to it to within 2^-25: of
the largest element, for each head's query (scaled by a power of two into [1, 2) first), and absolutely, for
the softmax weights (in [0, 1], beside a running sum ≥ 1), so only that and the accumulation order differ
from ``ieee``. ``fp16x2``: two terms, within 2^-22, a third fewer tensor-core products. ``ieee``: plain fp32
FMA on CUDA cores, about 15× less arithmetic per second on an H100/H200 (datasheet: 67 fp32 against 990 dense
fp16 TFLOP/s). fp16, not bf16: Triton's interpreter computes fp16 dots exactly and bf16 dots wrongly (as their
bit patterns)."""


@dataclasses.dataclass(frozen=True)
class Tile:
    """How the kernel cuts its work: ``block_h`` heads per program (16, 32 or 64: its two [block_h, D/2] fp32
    accumulators live in registers), ``block_k`` selected entries per loop step (16, 32 or 64; tl.dot needs
    ≥ 16), ``num_warps`` warps per program, ``precision`` one of `PRECISIONS`."""

    precision: str = "fp16x3"
    block_h: int = 16
    block_k: int = 16
    num_warps: int = 4

    def check(self) -> None:
        """Raises ValueError naming the field that is not one the kernel takes."""
        sizes = (self.block_h, self.block_k, self.num_warps)
        if not all(type(v) is int for v in sizes):  # bool and float are refused too
            raise ValueError(f"tile block_h, block_k and num_warps must be ints, got {sizes}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"tile precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.block_h not in (16, 32, 64) or self.block_k not in (16, 32, 64):
            raise ValueError(
                f"tile block_h and block_k must be 16, 32 or 64, got {self.block_h}, {self.block_k}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"tile num_warps must be a power of two ≤ 16, got {self.num_warps}")


_TERMS = {"fp16x3": 3, "fp16x2": 2, "ieee": 0}

DEFAULT_TILE = Tile()
"""The tile `sparse_partials` runs when given none, the one checked end to end on an H200 (`kvdiet golden
--device cuda` accepted, the device tests passed). At 1M context and 64 heads ``block_k`` 32 read 10–20%
faster there (``bench_triton_decode.py``), but with it as the default the golden check on CUDA kept 36 of 64
rows within tolerance (every argmax and decoded token still equal; with 16, all 64). In Triton's interpreter
the same golden run through this kernel keeps all 64 rows with either value, so the fault is in the compiled
code at head_dim 64 (Triton 3.6) or elsewhere on the GPU, not yet found: 32 is not the default."""


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
        TERMS: tl.constexpr,  # 2 or 3: the dots on fp16 tensor cores, q and p split in TERMS terms; 0: fp32 FMA
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
        if TERMS > 0:
            # each head's query times a power of two that brings its largest |element| into [1, 2) (undone,
            # exactly, on the scores), then as three fp16 terms that sum to it to within 2^-25 of that largest
            top = tl.maximum(tl.max(tl.abs(q_even), 1), tl.max(tl.abs(q_odd), 1))
            e = tl.minimum(tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 253)
            up = ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2^(127 − e)
            down = (e << 23).to(tl.float32, bitcast=True)  # 2^(e − 127)
            qs = q_even * up
            qe1 = qs.to(tl.float16)
            qe2 = (qs - qe1.to(tl.float32)).to(tl.float16)
            qe3 = (qs - qe1.to(tl.float32) - qe2.to(tl.float32)).to(tl.float16)  # unused when TERMS == 2
            qs = q_odd * up
            qo1 = qs.to(tl.float16)
            qo2 = (qs - qo1.to(tl.float32)).to(tl.float16)
            qo3 = (qs - qo1.to(tl.float32) - qo2.to(tl.float32)).to(tl.float16)
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
            # decoded by placing the bits in an fp16 (every value of both formats is exact there): the E4M3
            # scale's 7 magnitude bits as fp16 exponent (low 4) and mantissa (top 3) is scale·2^-8, an E2M1
            # nibble's sign as the sign and its 3 magnitude bits likewise is value·2^-14 (subnormals included)
            s = ((sbyte & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0
            lo = ((byte & 7) << 9) | ((byte & 8) << 12)
            hi = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
            v_even = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * s  # [BLOCK_K, HALF]
            v_odd = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * s
            if TERMS > 0:  # decoded values have ≤ 6 significant bits in [2^-10, 2688]: exact in fp16
                ve, vo = v_even.to(tl.float16), v_odd.to(tl.float16)
                vet, vot = tl.trans(ve), tl.trans(vo)
                scores = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
                if TERMS == 3:  # small terms first
                    scores = tl.dot(qe3, vet, scores)
                    scores = tl.dot(qo3, vot, scores)
                scores = tl.dot(qe2, vet, scores)
                scores = tl.dot(qo2, vot, scores)
                scores = tl.dot(qe1, vet, scores)
                scores = tl.dot(qo1, vot, scores) * down[:, None]  # [BLOCK_H, BLOCK_K]
            else:
                scores = tl.dot(q_even, tl.trans(v_even), input_precision="ieee")
                scores += tl.dot(q_odd, tl.trans(v_odd), input_precision="ieee")
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if TERMS > 0:  # p in [0, 1] as fp16 terms, within 2^-25 (three) or 2^-22 (two) of it
                p1 = p.to(tl.float16)
                p2 = (p - p1.to(tl.float32)).to(tl.float16)
                acc_even = acc_even * alpha[:, None]
                acc_odd = acc_odd * alpha[:, None]
                if TERMS == 3:
                    p3 = (p - p1.to(tl.float32) - p2.to(tl.float32)).to(tl.float16)
                    acc_even = tl.dot(p3, ve, acc_even)
                    acc_odd = tl.dot(p3, vo, acc_odd)
                acc_even = tl.dot(p1, ve, tl.dot(p2, ve, acc_even))
                acc_odd = tl.dot(p1, vo, tl.dot(p2, vo, acc_odd))
            else:
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
    tile: Tile | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax partials of ``q`` over the selected packed entries, ``splits`` programs per query.

    Args:
        q: fp32 [B, H, D] queries (D a multiple of 32).
        rows: uint8 [N, 9·D/16] packed ``fp4_e2m1_e4m3x16`` entries (the pool rows of one layer and kind).
        slots: int64 [B, K] the row of each selected entry, in [0, N) where ``valid`` (not checked: that would
            read the slots back to the host, a device sync; the pool's stores give only such rows); any value where
            ``valid`` is False.
        valid: bool [B, K].
        scale: softmax scale (head_dim^-½).
        splits: programs per query asked for (≥ 1); each covers max(⌈K / splits⌉, ``tile.block_k``)
            consecutive slots, so the S splits returned are ⌈K / that⌉ (at most ``splits``).
        tile: the kernel's arithmetic and block sizes (`Tile`; default `DEFAULT_TILE`).
    Returns:
        ``(m fp32 [B, S, H], l fp32 [B, S, H], acc fp32 [B, S, H, D])``: per split the largest scaled score
        (−inf when it saw no valid slot), Σ exp(score − m) and Σ exp(score − m)·value. Stored scale bytes
        are not checked as the torch decode checks them (a pool holds only what the encoder wrote): a byte
        outside the written range decodes as its 7 magnitude bits (0x7F as 480, the sign bit ignored).
    Raises:
        ValueError: shapes, dtypes or devices that do not fit (on the CPU: without Triton's interpreter), a bad
            ``tile``, or ``splits`` < 1.
    """
    if q.dim() != 3 or q.shape[-1] < 32:
        raise ValueError(f"need fp32 q [B, H, D] with D ≥ 32, got shape {tuple(q.shape)}")
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
    tile = tile or DEFAULT_TILE
    tile.check()
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("on the CPU the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1)")
    k = slots.shape[1]
    per_split = max(tile.block_k, -(-k // splits))
    splits = max(1, -(-k // per_split))
    m = torch.empty(b, splits, h, device=q.device)
    l_sum = torch.empty(b, splits, h, device=q.device)
    acc = torch.empty(b, splits, h, d, device=q.device)
    _kernel()[(-(-h // tile.block_h), b, splits)](
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
        BLOCK_H=tile.block_h,
        BLOCK_K=tile.block_k,
        TERMS=_TERMS[tile.precision],
        num_warps=tile.num_warps,
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
    tile: Tile | None = None,
) -> torch.Tensor:
    """`kvdiet.model.attention.attend` with the selected entries read packed: fp32 [B, H, D].

    Args:
        q: fp32 [B, H, D]; win_kv fp32 [L, D] shared by the queries, or [B, L, D] each query's own (its window
            band), with win_mask bool [B, L]; sink fp32 [H]; scale as ``attend``.
        rows, slots, valid, splits, tile: the packed selection and the kernel's tile, as `sparse_partials`.
    Raises:
        ValueError: as `sparse_partials`.
    """
    m, l_sum, acc = sparse_partials(q, rows, slots, valid, scale, splits=splits, tile=tile)
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
