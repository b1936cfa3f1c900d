"""The load plan: every tensor a model needs, matched against a checkpoint's headers and checked before any
data is read, as steps that read one tensor in the chosen numerics and put it into its module.

What each stored form becomes (the released checkpoint: v41-spec §10, shared/golden/README.md):

| stored | becomes |
|---|---|
| linear ``X.weight`` F8_E4M3 [out, in] + ``X.scale`` UE8M0 (or float) per b×b tile | FP8 `Linear` |
| linear ``X.weight`` F4, or I8/U8 nibbles, [out, in/2] + ``X.scale`` [out, in/32] | FP4 `Linear` |
| linear ``X.weight`` BF16/F16/F32 [out, in] | dense fp32 `Linear` |
| Engram ``embed.weight`` F8_E4M3/U8 [rows, dim] + ``embed.scale`` F8_E8M0/U8 [rows, dim/32] | its bytes |
| Engram ``embed.weight`` BF16/F32 [rows, dim] (no scale) | quantised to FP8 (``kvdiet.formats.fp8``) |
| anything else BF16/F16/F32 | fp32 of the parameter's shape |

Names are the model's ``state_dict()`` names (DeepSeek's, `kvdiet.model.loader`). Every mismatch (missing,
unexpected, mis-shaped or unsupported tensors) is collected and raised at once as `WeightsError`. Which
steps run, and when (all at once, or Engram tables row by row and routed experts on first use), is the
loader's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvdiet.formats.fp8 import quantize_window
from kvdiet.model.checkpoint import ROUTED_EXPERT, Checkpoint, TensorInfo, WeightsError
from kvdiet.model.engram import Fp8Embedding
from kvdiet.model.linear import Linear, dequantize_fp4_weight, dequantize_fp8_weight

__all__ = [
    "LinearStep",
    "Step",
    "TableStep",
    "TensorStep",
    "match_tensors",
    "read_linear",
    "storage_of",
    "tile_edge",
]

_FLOATS = ("F32", "BF16", "F16", "F64")
_FP4_CODES = ("F4", "I8", "U8")
_SCALE_CODES = ("F8_E8M0", "U8", *_FLOATS)
_TILE_EDGES = (32, 64, 128, 256)


@dataclass(slots=True)
class LinearStep:
    """A `Linear`'s weight (and scale), stored FP8 (tiles of ``block``), FP4 or dense."""

    module: Linear
    weight: TensorInfo
    scale: TensorInfo | None
    block: int

    def read(self, ckpt: Checkpoint, numerics: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return read_linear(ckpt, self.weight, self.scale, self.block, numerics)

    def apply(self, values: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.module.set_weight(values[0], values[1], block=self.block)


@dataclass(slots=True)
class TableStep:
    """An FP8 Engram table: its codes and scales as stored, or a float table quantised on read."""

    module: Fp8Embedding
    weight: TensorInfo
    scale: TensorInfo | None

    def read(self, ckpt: Checkpoint, numerics: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale is None:  # a float table: quantise it as the release stores it
            return quantize_window(ckpt.read(self.weight.name).float())
        return ckpt.read(self.weight.name).view(torch.uint8), ckpt.read(self.scale.name).view(torch.uint8)

    def apply(self, values: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.module.weight, self.module.scale = values


@dataclass(slots=True)
class TensorStep:
    """Any other parameter or buffer, read as fp32."""

    module: nn.Module
    attr: str
    info: TensorInfo

    def read(self, ckpt: Checkpoint, numerics: str) -> torch.Tensor:
        return ckpt.read(self.info.name).to(torch.float32)

    def apply(self, value: torch.Tensor) -> None:
        if self.attr in self.module._parameters:
            self.module._parameters[self.attr] = nn.Parameter(value, requires_grad=False)
        else:
            self.module._buffers[self.attr] = value


Step = LinearStep | TableStep | TensorStep
"""One tensor of the plan: ``read(ckpt, numerics)`` reads it (no model change), ``apply`` puts it in."""


def match_tensors(model: nn.Module, ckpt: Checkpoint, *, block: int | None, lazy_experts: bool) -> list[Step]:
    """Every tensor the model needs, matched and checked against the checkpoint's headers (no data read).

    Args:
        model: the model (usually a `Transformer`), built or on the meta device.
        ckpt: the checkpoint.
        block: the FP8 tile edge from the checkpoint's ``quantization_config`` (None: found per tensor).
        lazy_experts: leave routed experts out of the plan (checked, read on first use instead).
    Raises:
        WeightsError: listing every problem (missing, unexpected, shapes, dtypes).
    """
    tensors, claimed, problems, plan = ckpt.tensors, set(), [], []

    def take(name: str) -> TensorInfo | None:
        claimed.add(name)
        return tensors.get(name)

    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, Linear):
            w, s = take(f"{dot}weight"), take(f"{dot}scale")
            problem = _check_linear(module, f"{dot}weight", w, s, block)
            if problem:
                problems.append(problem)
            elif not (lazy_experts and ROUTED_EXPERT.match(prefix + ".")):
                plan.append(LinearStep(module, w, s, tile_edge(module, s, block)))
        elif isinstance(module, Fp8Embedding):
            w, s = take(f"{dot}weight"), take(f"{dot}scale")
            problem = _check_table(module, f"{dot}weight", w, s)
            if problem:
                problems.append(problem)
            else:
                plan.append(TableStep(module, w, s))
        else:
            own = list(module._parameters.items())
            own += [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
            for attr, target in own:
                if target is None:
                    continue
                name = f"{dot}{attr}"
                info = take(name)
                shape = tuple(target.shape)
                if info is None:
                    problems.append(f"missing tensor {name} {shape}")
                elif info.dtype not in _FLOATS:
                    problems.append(f"tensor {name} has dtype {info.dtype}, the model expects a float")
                elif info.shape != shape:
                    problems.append(f"tensor {name} has shape {info.shape}, the model expects {shape}")
                else:
                    plan.append(TensorStep(module, attr, info))
    problems += [f"unexpected tensor {name}" for name in tensors if name not in claimed]
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise WeightsError(
            f"checkpoint {ckpt.path} does not fit the model ({len(problems)} problems):\n  "
            + "\n  ".join(shown)
        )
    return plan


def _check_linear(
    lin: Linear, name: str, w: TensorInfo | None, s: TensorInfo | None, block: int | None
) -> str | None:
    dense = (lin.out_features, lin.in_features)
    if w is None:
        return f"missing tensor {name} {dense}"
    storage = storage_of(w)
    if storage is None:
        return f"tensor {name} has dtype {w.dtype}, unsupported for a linear layer"
    scale_name = name.removesuffix("weight") + "scale"
    if storage == "dense":
        if w.shape != dense:
            return f"tensor {name} has shape {w.shape}, the model expects {dense}"
        return f"unexpected tensor {scale_name} beside the {w.dtype} weight {name}" if s is not None else None
    if s is None:
        return f"tensor {name} is {w.dtype} but {scale_name} is missing"
    if s.dtype not in _SCALE_CODES:
        return f"tensor {scale_name} has dtype {s.dtype}, unsupported for a weight scale"
    want_w, want_s = lin.stored_shapes(storage, block=tile_edge(lin, s, block))
    if w.shape != want_w or s.shape != want_s:
        return (
            f"tensor {name} ({w.dtype} {w.shape}) with {scale_name} {s.shape} does not fit "
            f"[{lin.out_features}, {lin.in_features}]: {storage} stores {want_w} with scales {want_s}"
        )
    return None


def _check_table(module: Fp8Embedding, name: str, w: TensorInfo | None, s: TensorInfo | None) -> str | None:
    shape, scale_shape = (module.rows, module.dim), (module.rows, module.dim // 32)
    scale_name = name.removesuffix("weight") + "scale"
    if w is None:
        return f"missing tensor {name} {shape}"
    if w.shape != shape:
        return f"tensor {name} has shape {w.shape}, the model expects {shape}"
    if w.dtype in _FLOATS:
        return f"unexpected tensor {scale_name} beside the {w.dtype} table {name}" if s is not None else None
    if w.dtype not in ("F8_E4M3", "U8"):
        return f"tensor {name} has dtype {w.dtype}, unsupported for an FP8 table"
    if s is None or s.dtype not in ("F8_E8M0", "U8") or s.shape != scale_shape:
        got = "missing" if s is None else f"{s.dtype} {s.shape}"
        return f"FP8 table {name} needs {scale_name} F8_E8M0 {scale_shape}, got {got}"
    return None


def storage_of(w: TensorInfo) -> str | None:
    """How a linear's stored weight computes: ``"fp8"``, ``"fp4"``, ``"dense"``, or None (unsupported dtype)."""
    if w.dtype == "F8_E4M3":
        return "fp8"
    if w.dtype in _FP4_CODES:
        return "fp4"
    return "dense" if w.dtype in _FLOATS else None


def tile_edge(lin: Linear, s: TensorInfo | None, block: int | None) -> int:
    """The FP8 tile edge: the config's, else the one whose tile count matches the stored scale."""
    if block is not None or s is None or len(s.shape) != 2:
        return block or 0
    for edge in _TILE_EDGES:
        if s.shape == (-(-lin.out_features // edge), -(-lin.in_features // edge)):
            return edge
    return 0


def read_linear(
    ckpt: Checkpoint, w: TensorInfo, s: TensorInfo | None, block: int, numerics: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's ``(weight, scale)``: as stored under ``"fp8"`` numerics, dequantised to fp32 [out, in]
    (scale None) under ``"bf16"``; a dense weight as fp32 (scale None). ``block``: the FP8 tile edge."""
    weight = ckpt.read(w.name)
    if s is None:
        return weight.float(), None
    scale = ckpt.read(s.name)
    if numerics == "fp8":
        return weight, scale
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_weight(weight, scale, block=block), None
    return dequantize_fp4_weight(weight, scale), None
