"""What the packed formats share: argument checks, row chunking, block amax, UE8M0 and E4M3 scales.

Inputs are walked in cache-sized row chunks. Each block's absolute maximum is taken on the integer bits
of ``|x|``, which also rejects ±inf/NaN there (their bits sort above every finite magnitude), so the
non-finite check costs no extra pass. A ratio ``y = amax / grid_max`` becomes a stored scale byte:

- **UE8M0** (index keys, window entries, V4 records): ``s = 2^ceil(log2(y))`` with the ceil taken on the
  exact fp32 bits (a non-zero mantissa bumps the exponent; v41-spec §5.1, DeepSeek reference kernel
  ``fast_log2_ceil``). Byte = exponent + 127; each format caps the exponent so that ``grid_max · s`` is
  finite, so 0xFF (NaN) is never written.
- **E4M3** (V4.1 main KV): ``s = e4m3(y)`` by ``torch.float8_e4m3fn`` round-to-nearest-even after clamping
  ``y`` to [2^-9, 448] as vLLM ``nvfp4_ds_mla`` does: the byte is 0x01..0x7E, never 0 or NaN (0x7F/0xFF).

It knows no particular entry layout (``layout`` declares them) and no value grid (``e2m1``, ``fp8``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvdiet.formats.layout import EntryFormat

__all__ = [
    "CHUNK_VALUES",
    "E4M3_MAX",
    "E4M3_SCALE_BYTES",
    "PendingCheck",
    "as_rows",
    "block_amax",
    "check_codes_and_scales",
    "check_scale_bytes",
    "chunk_rows",
    "decode_rows",
    "e4m3_scale",
    "e4m3_scale_to_float",
    "entry_of_packed",
    "non_finite_error",
    "output_dtype",
    "row_chunks",
    "run_checks",
    "ue8m0_scale",
    "ue8m0_to_float",
]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""
E4M3_SCALE_BYTES = (0x01, 0x7E)
"""E4M3 scale bytes ``e4m3_scale`` writes: 2^-9 .. 448."""
CHUNK_VALUES = 1 << 19
"""Values per work chunk (2 MiB as fp32): the ~20 elementwise passes of a quantiser then run on cached data
(L2/L3) while each op still has enough work to amortise dispatch and thread start-up."""

# dtype -> (integer view, abs mask, bits of +inf): for floats >= 0, order of values = order of bits.
_BITS = {
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
}


def as_rows(x: torch.Tensor, *, block: int, name: str) -> torch.Tensor:
    """Check a quantiser input ``[..., dim]`` (any leading dims); return it as contiguous rows ``[N, dim]``.

    The result is detached: quantisation is not differentiable, and its outputs never require grad.

    Raises:
        ValueError: a dtype other than float32/bfloat16/float16, a scalar, or a ``dim`` that is not a
            positive multiple of ``block``.
    """
    if x.dtype not in _BITS:
        raise ValueError(f"{name}: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % block:
        raise ValueError(f"{name}: last dim must be a positive multiple of {block}, got {list(x.shape)}")
    return x.detach().reshape(-1, x.shape[-1]).contiguous()


def chunk_rows(rows: int, dim: int) -> int:
    """Rows per work chunk: about ``CHUNK_VALUES`` values, at least 1, at most ``rows``."""
    return min(rows, max(1, CHUNK_VALUES // dim))


def row_chunks(rows: int, dim: int) -> Iterator[slice]:
    """Consecutive row slices covering ``rows``, ``chunk_rows`` rows each."""
    step = max(1, chunk_rows(rows, dim))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def block_amax(
    xb: torch.Tensor,
    work: torch.Tensor,
    *,
    name: str,
    first_row: int = 0,
    pending: list[PendingCheck] | None = None,
) -> torch.Tensor:
    """Exact absolute maximum per block: ``xb`` float32/bf16/fp16 ``[r, nb, block]`` → float32 ``[r, nb]``.

    ``work``: contiguous int32 scratch of at least ``xb.numel()`` elements. ``first_row``: index of ``xb``'s
    first row in the caller's input, for the error. ``pending``: None checks now (one host read); a list gets
    the check appended as a `PendingCheck` (no host read) and a non-finite block's amax becomes the largest
    finite value, so its scale is finite (the same amax for every finite block).

    Raises:
        ValueError: a block holds ±inf or NaN, naming the row (``pending`` None; else the check's error).
    """
    itype, mask, inf_bits = _BITS[xb.dtype]
    mag = torch.bitwise_and(xb.view(itype), mask, out=work.view(itype)[: xb.numel()].view(xb.shape))
    amax = mag.amax(-1)
    if pending is not None and amax.numel():
        bad_rows = (amax >= inf_bits).any(-1)  # [r]
        pending.append(
            PendingCheck(
                bad_rows.any(), lambda: non_finite_error(name, first_row + int(bad_rows.nonzero()[0]))
            )
        )
        amax.clamp_(max=inf_bits - 1)
    elif amax.numel() and int(amax.max()) >= inf_bits:
        raise non_finite_error(name, first_row + int((amax >= inf_bits).any(-1).nonzero()[0]))
    return amax.view(xb.dtype).float()


def non_finite_error(name: str, row: int) -> ValueError:
    """The error for an input row holding ±inf or NaN (``row``: index in the caller's rows)."""
    return ValueError(f"{name}: input holds a non-finite value (±inf or NaN) in row {row}")


def ue8m0_scale(y: torch.Tensor, *, max_exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^e, byte e + 127)`` with ``e = min(ceil(log2 y), max_exponent)``, for float32 ``y ≥ 2^-126``.

    ``(bits + 0x7FFFFF) >> 23`` is the biased exponent, plus one when the mantissa is non-zero.
    """
    biased = torch.bitwise_right_shift(y.view(torch.int32) + 0x7FFFFF, 23).clamp_(max=max_exponent + 127)
    return torch.bitwise_left_shift(biased, 23).view(torch.float32), biased.to(torch.uint8)


def ue8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 bytes (``2^(byte − 127)``) to float32."""
    return scale_bytes.view(torch.float8_e8m0fnu).float()


def e4m3_scale(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, byte)``: float32 ``y`` clamped to [2^-9, 448] and rounded to nearest-even E4M3."""
    scale_bytes = y.clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return e4m3_scale_to_float(scale_bytes), scale_bytes


def e4m3_scale_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 scale bytes (0x01..0x7E) to float32, exactly.

    By bits, as ``fp8.dequantize_e4m3_chunk_`` does (torch's float8 → float32 cast is slow on CPU): the
    byte shifted left 7 is an fp16 equal to the E4M3 value × 2^-8.
    """
    half = scale_bytes.to(torch.int16).bitwise_left_shift_(7)
    return half.view(torch.float16).float().mul_(256.0)


def decode_rows(
    rows: int,
    dim: int,
    fill: Callable[[slice, torch.Tensor], None],
    *,
    dtype: torch.dtype,
    name: str,
    device: torch.device,
) -> torch.Tensor:
    """Allocate ``[rows, dim]`` of ``dtype`` on ``device``; ``fill(row_slice, out)`` writes each chunk as
    float32.

    Every dequantised value here is exact in bfloat16 (≤ 6 significant bits: an E2M1 value times an E4M3
    scale, or an E2M1/E4M3 value times a power of two, inside bf16's exponent range), so bfloat16 output is
    lossless. It goes through a float32 chunk and one narrowing copy: torch's CPU bf16 arithmetic is slower.

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16.
    """
    out = torch.empty(rows, dim, dtype=output_dtype(dtype, name=name), device=device)
    scratch = None if dtype == torch.float32 else torch.empty(chunk_rows(rows, dim), dim, device=device)
    for sl in row_chunks(rows, dim):
        chunk = out[sl] if scratch is None else scratch[: sl.stop - sl.start]
        fill(sl, chunk)
        if scratch is not None:
            out[sl].copy_(chunk)
    return out


def output_dtype(dtype: torch.dtype, *, name: str) -> torch.dtype:
    """``dtype`` if it is a dequantiser output dtype (float32 or bfloat16).

    Raises:
        ValueError: any other dtype.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: output dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def check_scale_bytes(
    scale_bytes: torch.Tensor,
    valid: tuple[int, int],
    *,
    name: str,
    pending: list[PendingCheck] | None = None,
) -> torch.Tensor:
    """Reject stored scale bytes ``scale_bytes`` (uint8, any shape, any device) outside ``valid`` (inclusive),
    the range the format's quantiser writes. One host read (one device wait on a GPU) however many bytes, or
    none when ``pending`` is a list: the check is appended to it as a `PendingCheck` instead.

    Within it every decoded scale, and every dequantised value, is finite.

    Returns:
        The bytes to decode: ``scale_bytes`` itself, or with ``pending`` a copy clamped into ``valid`` (a corrupt
        byte, reported when the check is run, reads as in range meanwhile: no inf or NaN).

    Raises:
        ValueError: a byte outside the range (a corrupt or foreign entry), naming it (``pending`` None; else
            the check's error).
    """
    if not scale_bytes.numel():
        return scale_bytes
    ends = torch.stack(torch.aminmax(scale_bytes))  # [2]: lowest, highest
    if pending is not None:
        pending.append(
            PendingCheck((ends[0] < valid[0]) | (ends[1] > valid[1]), lambda: _scale_error(ends, valid, name))
        )
        return scale_bytes.clamp(*valid)
    # one host read of both ends (on a GPU each read waits for the device: this check runs on every decode)
    lo, hi = ends.tolist()
    if lo < valid[0] or hi > valid[1]:
        raise _scale_error(ends, valid, name)
    return scale_bytes


def _scale_error(ends: torch.Tensor, valid: tuple[int, int], name: str) -> ValueError:
    """The error for scale bytes whose ``ends`` (uint8 [2], lowest and highest) leave ``valid``."""
    lo, hi = ends.tolist()
    bad = lo if lo < valid[0] else hi
    return ValueError(f"{name}: stored scale byte {bad} is outside the written range {valid}")


@dataclass(frozen=True, slots=True)
class PendingCheck:
    """A value check left on the device, to be read later with others in one host read (`run_checks`).

    Attributes:
        failed: bool [] on the checked values' device, True where the check fails.
        error: the ValueError the check raises then (reads the device; called only on failure).
    """

    failed: torch.Tensor
    error: Callable[[], ValueError]


def run_checks(checks: Sequence[PendingCheck]) -> None:
    """Read every check's ``failed`` in one host read (none for no checks) and raise the first failed one's
    error, in ``checks``' order.

    Raises:
        ValueError: the first failed check's error.
    """
    if not checks:
        return
    for check, failed in zip(checks, torch.stack([c.failed for c in checks]).tolist(), strict=True):
        if failed:
            raise check.error()


def check_codes_and_scales(
    codes: torch.Tensor,
    scales: torch.Tensor,
    entry: Callable[[int], EntryFormat],
    *,
    codes_dtype: torch.dtype,
    scale_bytes: tuple[int, int],
    name: str,
) -> EntryFormat:
    """Check ``(codes [..., dim], scales [..., num_scales])`` for a packer/dequantiser; return ``entry(dim)``.

    Raises:
        ValueError: wrong dtypes, a scalar, a ``dim`` the format does not fit (from ``layout``), scales of
            another shape, or a scale byte outside ``scale_bytes``.
    """
    if codes.dtype != codes_dtype or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: need {codes_dtype} codes, uint8 scales; got {codes.dtype}, {scales.dtype}")
    if codes.dim() == 0:
        raise ValueError(f"{name}: codes need a last dim (values per entry), got a scalar")
    fmt = entry(codes.shape[-1])
    if scales.shape != (*codes.shape[:-1], fmt.num_scales):
        raise ValueError(f"{name}: scales {list(scales.shape)} do not fit codes {list(codes.shape)}")
    check_scale_bytes(scales, scale_bytes, name=name)
    return fmt


def entry_of_packed(
    packed: torch.Tensor,
    dim_of_width: Callable[[int], int],
    entry: Callable[[int], EntryFormat],
    *,
    name: str,
) -> EntryFormat:
    """Entry format of packed entries uint8 ``[..., width]``; ``dim_of_width`` inverts the width formula.

    Raises:
        ValueError: ``packed`` is not uint8, is a scalar, or its width is no entry width of the format.
    """
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(f"{name}: packed must be uint8 [..., B], got {packed.dtype} {list(packed.shape)}")
    width = packed.shape[-1]
    try:
        fmt = entry(dim_of_width(width))
    except ValueError:
        fmt = None
    if fmt is None or fmt.bytes_per_entry != width:
        raise ValueError(f"{name}: packed width {width} B is not an entry width of this format")
    return fmt
