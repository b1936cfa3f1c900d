"""The model's linear layer, with its weight stored as the checkpoint stores it: dense, FP8 or FP4.

``y = x · Wᵀ`` (no bias). The weight's storage picks the arithmetic, as in DeepSeek's reference ``linear``
(v41-spec §5.1, §10):

| storage | ``weight`` | ``scale`` (UE8M0) | what runs |
|---|---|---|---|
| dense | fp32 [out, in] | — | ``x · Wᵀ`` in fp32 |
| fp8 | float8_e4m3fn [out, in] | [⌈out/b⌉, ⌈in/b⌉], one per b×b tile (b = 32 in V4.1) | FP8 activations × W |
| fp4 | float4_e2m1fn_x2 [out, in/2], even element in the low nibble | [out, in/32] | FP8 activations × W |

"FP8 activations" is the reference's ``act_quant(x, 32, ue8m0)``: the input's last dim is cut into blocks of
32, each scaled by ``2^ceil(log2(max(amax, 1e-4)/448))`` and rounded to E4M3 (`fp8_activations`, the same
recipe as the window cache, ``kvdiet.formats.fp8``). The weight is dequantised exactly (every E4M3 and E2M1
value times a power of two is an fp32 value) and the product runs in fp32 (DeepSeek's ``fp8_gemm`` /
``fp4_gemm`` scale per-block partial sums instead: the same values, summed in another order, so the two agree
to fp32 rounding). A few rows (a decode step's) run in `kvdiet.model.gemv`'s fixed order at the read bandwidth,
more rows in the BLAS's. Only the stored bytes stay resident: 1 B (FP8) or ½ B (FP4) per weight; the fp32 weight
is rebuilt on every call (memory over speed).

This module knows nothing about checkpoints (``kvdiet.model.loader`` sets the storage) or about which layers
DeepSeek quantises.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from kvdiet.formats.e2m1 import DECODE_TABLE, pack_nibbles
from kvdiet.formats.fp8 import fake_quant_window
from kvdiet.formats.mxfp4 import quantize_index_key
from kvdiet.model.gemv import linear
from kvdiet.model.layers import as_dtype, widen
from kvdiet.model.member import stands_in

__all__ = [
    "ACT_BLOCK",
    "FP4_BLOCK",
    "Linear",
    "dequantize_fp4_weight",
    "dequantize_fp8_weight",
    "fp8_activations",
    "quantize_fp4_weight",
    "quantize_fp8_weight",
    "ue8m0_values",
]

FP4_BLOCK = 32
"""Weights per UE8M0 scale along the input dim of an FP4 (MXFP4) weight (v41-spec §8.2)."""
ACT_BLOCK = 32
"""Values per FP8 activation scale along a quantised linear's input (reference ``act_quant(x, 32, ...)``)."""
_STORAGES = ("dense", "fp8", "fp4")


def ue8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as fp32 values: UE8M0 (``float8_e8m0fnu`` or its uint8 bytes) → ``2^(byte − 127)``;
    any other float dtype is taken as the values themselves.

    Raises:
        ValueError: a UE8M0 byte 255 (NaN).
    """
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        raw = scale.view(torch.uint8)
        if bool((raw == 255).any()):
            raise ValueError("UE8M0 scale byte 255 (NaN)")
        return raw.view(torch.float8_e8m0fnu).float()
    return scale.float()


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, *, block: int) -> torch.Tensor:
    """fp32 [out, in] of an E4M3 weight [out, in] with one scale per ``block × block`` tile.

    Args:
        weight: float8_e4m3fn [out, in].
        scale: [⌈out/block⌉, ⌈in/block⌉], UE8M0 or float (see `ue8m0_values`).
        block: tile edge (config ``quantization_config.weight_block_size``).
    """
    out_f, in_f = weight.shape
    s = ue8m0_values(scale)
    tiles = s.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return weight.float() * tiles


def dequantize_fp4_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] of an E2M1 weight stored two per byte ([out, in/2], even element in the low nibble)
    with one scale per `FP4_BLOCK` input values ([out, in/32], UE8M0 or float)."""
    packed = weight.view(torch.uint8)
    index = packed.reshape(-1).to(torch.int64)
    # one 8-byte gather per byte: both nibbles' fp32 values, the low nibble's first (element order)
    values = (
        torch.index_select(_byte_pairs(packed.device), 0, index).view(torch.float32).view(packed.shape[0], -1)
    )
    s = ue8m0_values(scale)
    return values.view(values.shape[0], -1, FP4_BLOCK).mul_(s[..., None]).view(values.shape)


@functools.cache
def _byte_pairs(device: torch.device) -> torch.Tensor:
    """float64-typed [256] on ``device``: byte b's two E2M1 values as fp32, low nibble first (a gather unit,
    not a number); built once per device."""
    grid = torch.tensor(DECODE_TABLE, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([grid[byte & 15], grid[byte >> 4]], dim=1).contiguous().view(torch.float64).view(256)


def quantize_fp8_weight(weight: torch.Tensor, *, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dequantize_fp8_weight`: fp32 [out, in] → (float8_e4m3fn [out, in], float8_e8m0fnu
    [⌈out/b⌉, ⌈in/b⌉]); per tile ``s = 2^ceil(log2(max(amax, 1e-4)/448))``, values rounded to E4M3
    (nearest, ties to even), as DeepSeek's FP8 weights are stored.

    Raises:
        ValueError: ``weight`` is not 2-D or holds ±inf/NaN.
    """
    if weight.dim() != 2 or not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_fp8_weight needs a finite 2-D weight")
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_f, :in_f] = weight.float()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scale = torch.exp2(exponent)
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = q.view(rows * block, cols * block)[:out_f, :in_f].contiguous()
    return codes, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `dequantize_fp4_weight`: fp32 [out, in] → (float4_e2m1fn_x2 [out, in/2], float8_e8m0fnu
    [out, in/32]), the MXFP4 recipe of ``kvdiet.formats.mxfp4`` (scale ``2^ceil(log2(amax/6))`` per 32).

    Raises:
        ValueError: ``in`` not a multiple of 32, or non-finite values.
    """
    codes, scales = quantize_index_key(weight.float())
    return pack_nibbles(codes).view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)


def fp8_activations(x: torch.Tensor) -> torch.Tensor:
    """The reference's FP8 activation quantisation of ``x`` [..., in] (in a multiple of 32), as fp32 values.

    Per 32 values: ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``q = e4m3(clamp(x/s, ±448))``, value ``q·s``
    (v41-spec §5.1 ``act_quant``; ``kvdiet.formats.fp8`` documents rounding and edge cases).

    Raises:
        ValueError: ``in`` is not a multiple of 32, or ``x`` holds ±inf/NaN.
    """
    return fake_quant_window(x.float())


@stands_in
class Linear(nn.Module):
    """``y = x · Wᵀ`` with the weight stored dense, FP8 or FP4 (see the module docstring).

    Parameters (checkpoint names ``X.weight`` and, when quantised, ``X.scale``): ``weight`` as the table
    above; ``scale`` a buffer, present only when quantised. A new layer is dense fp32, initialised
    as ``torch.nn.Linear`` (`Transformer.init_weights` then fills it).

    Args:
        in_features / out_features: the logical shape of the weight [out, in].
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.storage = "dense"
        self.block = 0  # FP8 tile edge (fp8 storage only)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.register_buffer("scale", None)
        # Draw from the RNG as torch's nn.Linear does, so seeded random models keep their weights (a layer
        # built on the meta device is filled by the loader: no initialisation, which is slow there).
        if self.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def stored_shapes(
        self, storage: str, *, block: int = 0
    ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """``(weight shape, scale shape or None)`` of this layer in ``storage`` ("dense", "fp8", "fp4").

        Raises:
            ValueError: an unknown storage; fp4 with ``in_features`` not a multiple of 32; fp8 with
                ``block`` < 1.
        """
        o, i = self.out_features, self.in_features
        if storage == "dense":
            return (o, i), None
        if storage == "fp8":
            if block < 1:
                raise ValueError(f"FP8 weights need a tile edge >= 1, got {block}")
            return (o, i), (-(-o // block), -(-i // block))
        if storage == "fp4":
            if i % FP4_BLOCK:
                raise ValueError(f"FP4 weights need in_features divisible by {FP4_BLOCK}, got {i}")
            return (o, i // 2), (o, i // FP4_BLOCK)
        raise ValueError(f"unknown weight storage {storage!r} (one of {', '.join(_STORAGES)})")

    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None, *, block: int = 0) -> None:
        """Replace the weight (and scale) by stored tensors; the storage follows ``weight.dtype``.

        Args:
            weight: float8_e4m3fn (fp8), float4_e2m1fn_x2 or uint8/int8 packed nibbles (fp4), or any other
                float dtype (dense, kept as fp32).
            scale: the quantised weight's scales (UE8M0 or float); None for dense.
            block: FP8 tile edge.
        Raises:
            ValueError: shapes that do not match `stored_shapes`, or a missing/extra scale.
        """
        if weight.dtype == torch.float8_e4m3fn:
            storage = "fp8"
        elif weight.dtype in (torch.float4_e2m1fn_x2, torch.uint8, torch.int8):
            storage, weight = "fp4", weight.view(torch.uint8)
        else:
            storage, weight = "dense", weight.float()
        want_w, want_s = self.stored_shapes(storage, block=block)
        if tuple(weight.shape) != want_w:
            raise ValueError(f"{storage} weight has shape {tuple(weight.shape)}, expected {want_w}")
        if (scale is None) != (want_s is None) or (scale is not None and tuple(scale.shape) != want_s):
            got = None if scale is None else tuple(scale.shape)
            raise ValueError(f"{storage} weight needs a scale of shape {want_s}, got {got}")
        self.storage, self.block = storage, block if storage == "fp8" else 0
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = scale

    def dense_weight(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (dequantised when stored quantised; a dense fp64 weight stays fp64)."""
        if self.storage == "fp8":
            return dequantize_fp8_weight(self.weight, self.scale, block=self.block)
        if self.storage == "fp4":
            return dequantize_fp4_weight(self.weight, self.scale)
        return widen(self.weight)

    # Instrumentation (`kvdiet golden`'s rounding-tie search): when set, ``input_hook(layer, x, q)`` sees each
    # quantised layer's input x and its FP8 values q and returns the values to use. None in normal runs.
    input_hook: ClassVar[Callable[[Linear, torch.Tensor, torch.Tensor], torch.Tensor] | None] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] any float dtype → fp32 [..., out] (fp64 for a dense fp64 weight: a model run in fp64);
        FP8 activations first when the weight is quantised."""
        if self.storage == "dense":
            weight = self.weight
            return linear(as_dtype(x, weight.dtype), weight)
        q = fp8_activations(x)
        if Linear.input_hook is not None:
            q = Linear.input_hook(self, x.float(), q)
        return linear(q, self.dense_weight())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, storage={self.storage}"
