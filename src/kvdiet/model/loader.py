"""Weights into the model from safetensors checkpoints under DeepSeek's reference tensor names.

The model's module tree is laid out so that ``state_dict()`` names are DeepSeek's checkpoint names (no
``model.`` prefix; other spellings are mapped by `kvdiet.model.checkpoint.reference_name`)::

    embed.weight                          head.weight            norm.weight
    layers.{i}.attn_norm.weight           layers.{i}.ffn_norm.weight
    layers.{i}.hc_attn_fn / hc_attn_base / hc_attn_scale   (and hc_ffn_*)
    layers.{i}.attn.wq_a.weight  .q_norm.weight  .wq_b.weight  .wkv.weight  .kv_norm.weight
    layers.{i}.attn.wo_a.weight  .wo_b.weight  .attn_sink
    layers.{i}.attn.compressor.wkv.weight  .wgate.weight (ratio > 1)  .norm.weight      (Full layers)
    layers.{i}.attn.indexer.wq_b.weight  .weights_proj.weight  [.wk.weight  .k_norm.weight (Full)]
    layers.{i}.ffn.gate.weight  .gate.bias  .experts.{e}.w1/w2/w3.weight  .shared_experts.w1/w2/w3.weight
    layers.{i}.engram.embed.weight  .embed.scale  .wkv.weight  .q_weight  .k_weight   (Engram layers)

What each stored form becomes (the released checkpoint: v41-spec §10, shared/golden/README.md):

| stored | becomes |
|---|---|
| linear ``X.weight`` F8_E4M3 [out, in] + ``X.scale`` UE8M0 (or float) per b×b tile | FP8 `Linear` |
| linear ``X.weight`` F4, or I8/U8 nibbles, [out, in/2] + ``X.scale`` [out, in/32] | FP4 `Linear` |
| linear ``X.weight`` BF16/F16/F32 [out, in] | dense fp32 `Linear` |
| Engram ``embed.weight`` F8_E4M3/U8 [rows, dim] + ``embed.scale`` F8_E8M0/U8 [rows, dim/32] | its bytes |
| Engram ``embed.weight`` BF16/F32 [rows, dim] (no scale) | quantised to FP8 (``kvdiet.formats.fp8``) |
| anything else BF16/F16/F32 | fp32 of the parameter's shape |

**Numerics** (``numerics``): ``"fp8"`` keeps FP8/FP4 weights as stored and quantises their inputs to FP8,
as DeepSeek's reference runs the release; ``"bf16"`` dequantises every weight to fp32 on load and runs plain
matmuls (kvdiet's path for bf16 weights); ``"auto"`` follows the checkpoint's ``quantization_config``
(``quant_method: fp8`` → fp8), or, without one, whether any linear is stored quantised.

Two entry points: `load_weights` fills a model already built (every tensor read, all or nothing);
`load_checkpoint` builds the model on the meta device and fills it from a checkpoint folder, reading
routed experts on first use (`kvdiet.model.expert_cache`) and Engram tables larger than
``table_resident_bytes`` row by row, so resident memory stays far below the checkpoint's size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvdiet.config import NUMERICS, ConfigError, ModelConfig, load_config
from kvdiet.formats.fp8 import quantize_window
from kvdiet.model.checkpoint import ROUTED_EXPERT, Checkpoint, TensorInfo, WeightsError
from kvdiet.model.engram import Fp8Embedding
from kvdiet.model.expert_cache import ExpertCache
from kvdiet.model.linear import Linear, dequantize_fp4_weight, dequantize_fp8_weight
from kvdiet.model.memory import available_memory_bytes, check_fits, checkpoint_footprint
from kvdiet.model.moe import Expert
from kvdiet.model.transformer import Transformer

__all__ = [
    "NUMERICS",
    "LoadReport",
    "WeightsError",
    "load_checkpoint",
    "load_weights",
    "resolve_numerics",
    "save_weights",
]

_FLOATS = ("F32", "BF16", "F16", "F64")
_FP4_CODES = ("F4", "I8", "U8")
_SCALE_CODES = ("F8_E8M0", "U8", *_FLOATS)
_TILE_EDGES = (32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a load did.

    Attributes:
        numerics: the numerics that run, ``"fp8"`` or ``"bf16"`` (module docstring).
        linears: number of linear layers by storage (``dense``, ``fp8``, ``fp4``), lazily read experts
            included.
        skipped: stored tensors a text model does not run (MTP/DSpark, vision), not read.
        lazy_experts: routed experts are read on first use; ``expert_cache`` is then their cache.
        row_tables: Engram tables served row by row from the checkpoint.
        checkpoint_bytes: bytes of every tensor the text model may read.
    """

    numerics: str
    linears: dict[str, int]
    skipped: int
    lazy_experts: bool
    row_tables: tuple[str, ...]
    checkpoint_bytes: int
    expert_cache: ExpertCache | None = None


def resolve_numerics(numerics: str, quantization_config: dict | None, *, has_quantized: bool) -> str:
    """``"fp8"`` or ``"bf16"`` for a ``numerics`` choice (see the module docstring).

    Raises:
        ValueError: ``numerics`` is not one of `NUMERICS`.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if numerics != "auto":
        return numerics
    if quantization_config is not None:
        return "fp8" if quantization_config.get("quant_method") == "fp8" else "bf16"
    return "fp8" if has_quantized else "bf16"


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Write every parameter and buffer of ``model`` to one safetensors file, in its storage (FP8/FP4
    linears as their bytes and scales).

    Raises:
        ValueError: a tensor is not resident (a model whose experts are read on first use).
    """
    out = Path(path)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    lazy = [name for name, t in tensors.items() if t.device.type == "meta"]
    if lazy:
        raise ValueError(f"{len(lazy)} tensors are not resident (e.g. {lazy[0]}); load the model eagerly")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "writer": "kvdiet"})
    return out


def load_weights(model: Transformer, path: str | Path, *, numerics: str = "auto") -> LoadReport:
    """Load a checkpoint (file or folder) into the built ``model``: every tensor, all or nothing.

    Raises:
        WeightsError: missing, unexpected or mis-shaped tensors, or unsupported dtypes (all named; nothing
            is loaded then), or an unreadable file.
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: an unknown ``numerics``.
    """
    ckpt = Checkpoint.open(path)
    chosen = resolve_numerics(numerics, _quantization_config(ckpt), has_quantized=_has_quantized(ckpt))
    plan = _match(model, ckpt, block=_block(ckpt), lazy_experts=False)
    staged = [(step, step.read(ckpt, chosen)) for step in plan]  # read everything before touching the model
    for step, values in staged:
        step.apply(values)
    return LoadReport(chosen, _count_linears(model), len(ckpt.skipped), False, (), ckpt.nbytes)


def load_checkpoint(
    path: str | Path,
    *,
    config: ModelConfig | None = None,
    token_map: torch.Tensor | None = None,
    numerics: str = "auto",
    exact: bool = False,
    expert_cache_bytes: int | None = None,
    table_resident_bytes: int = 1 << 30,
) -> tuple[Transformer, LoadReport]:
    """Build a V4.1 model from a checkpoint folder without materialising what it does not use yet.

    Args:
        path: a folder with ``config.json`` and safetensors (one file or shards + index), or a file.
        config: the model config; None → the ``config.json`` beside the weights.
        token_map: Engram compressed-token map (see `Transformer`).
        numerics: ``auto``, ``fp8`` or ``bf16`` (module docstring).
        exact: unquantised fp32 caches (see `Transformer`).
        expert_cache_bytes: resident routed-expert bytes to stay within; None → all experts when they fit,
            else what 80% of the memory left after the resident tensors holds.
        table_resident_bytes: Engram tables above this many bytes are read row by row from the file.
    Returns:
        ``(model in eval mode, LoadReport)``.
    Raises:
        WeightsError / FileNotFoundError / ValueError: as `load_weights`; ConfigError: no config.
        InsufficientMemoryError: the resident tensors and one token's experts do not fit in the memory
            available (checked from the headers, before anything is read).
    """
    ckpt = Checkpoint.open(path)
    if config is None:
        if ckpt.config_path is None:
            raise ConfigError(f"no config.json beside the weights in {path}; give the model's config")
        loaded = load_config(ckpt.config_path)
        if not isinstance(loaded, ModelConfig) or not loaded.is_v41:
            raise ConfigError(f"{ckpt.config_path} is not a DeepSeek-V4.1 config")
        config = loaded
    chosen = resolve_numerics(numerics, _quantization_config(ckpt), has_quantized=_has_quantized(ckpt))
    footprint = checkpoint_footprint(ckpt, config, numerics=chosen, table_resident_bytes=table_resident_bytes)
    available = available_memory_bytes()
    check_fits(f"checkpoint {path} ({chosen} numerics)", footprint.minimum, have=available)
    model = Transformer(config, exact=exact, token_map=token_map, meta=True)
    block = _block(ckpt)
    plan = _match(model, ckpt, block=block, lazy_experts=True)
    row_tables = []
    for step in plan:
        if (
            isinstance(step, _TableStep)
            and step.weight.nbytes > table_resident_bytes
            and step.scale is not None
        ):
            step.module.read_rows_from(ckpt, step.weight.name, step.scale.name)
            row_tables.append(step.weight.name)
        else:
            step.apply(step.read(ckpt, chosen))
    cache = None
    if config.n_routed_experts:
        budget = expert_cache_bytes
        if budget is None:  # every expert if they fit, else what 80% of the memory left holds
            spare = int(0.8 * (available - footprint.resident))
            budget = max(footprint.expert_working_set, min(footprint.experts, spare))
        cache = ExpertCache(_expert_builder(config, ckpt, block, chosen), budget)
        for layer in model.layers:
            layer.ffn.routed = cache.layer(layer.info.layer_id)
    linears = _count_linears(model)
    for name, info in ckpt.tensors.items():
        if name.endswith(".weight") and ROUTED_EXPERT.match(name):
            linears[_storage_of(info)] += 1
    report = LoadReport(chosen, linears, len(ckpt.skipped), True, tuple(row_tables), ckpt.nbytes, cache)
    model.weights_digest = _headers_digest(ckpt)
    return model.eval(), report


# --- matching tensors to the model ------------------------------------------------------------------


@dataclass(slots=True)
class _LinearStep:
    module: Linear
    weight: TensorInfo
    scale: TensorInfo | None
    block: int

    def read(self, ckpt: Checkpoint, numerics: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _read_linear(ckpt, self.weight, self.scale, self.block, numerics)

    def apply(self, values: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.module.set_weight(values[0], values[1], block=self.block)


@dataclass(slots=True)
class _TableStep:
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
class _TensorStep:
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


_Step = _LinearStep | _TableStep | _TensorStep


def _match(model: Transformer, ckpt: Checkpoint, *, block: int | None, lazy_experts: bool) -> list[_Step]:
    """Every tensor the model needs, matched and checked against the checkpoint's headers (no data read).

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
                plan.append(_LinearStep(module, w, s, _edge(module, s, block)))
        elif isinstance(module, Fp8Embedding):
            w, s = take(f"{dot}weight"), take(f"{dot}scale")
            problem = _check_table(module, f"{dot}weight", w, s)
            if problem:
                problems.append(problem)
            else:
                plan.append(_TableStep(module, w, s))
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
                    plan.append(_TensorStep(module, attr, info))
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
    storage = _storage_of(w)
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
    want_w, want_s = lin.stored_shapes(storage, block=_edge(lin, s, block))
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


def _storage_of(w: TensorInfo) -> str | None:
    if w.dtype == "F8_E4M3":
        return "fp8"
    if w.dtype in _FP4_CODES:
        return "fp4"
    return "dense" if w.dtype in _FLOATS else None


def _edge(lin: Linear, s: TensorInfo | None, block: int | None) -> int:
    """The FP8 tile edge: the config's, else the one whose tile count matches the stored scale."""
    if block is not None or s is None or len(s.shape) != 2:
        return block or 0
    for edge in _TILE_EDGES:
        if s.shape == (-(-lin.out_features // edge), -(-lin.in_features // edge)):
            return edge
    return 0


def _read_linear(
    ckpt: Checkpoint, w: TensorInfo, s: TensorInfo | None, block: int, numerics: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = ckpt.read(w.name)
    if s is None:
        return weight.float(), None
    scale = ckpt.read(s.name)
    if numerics == "fp8":
        return weight, scale
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_weight(weight, scale, block=block), None
    return dequantize_fp4_weight(weight, scale), None


def _expert_builder(
    cfg: ModelConfig, ckpt: Checkpoint, block: int | None, numerics: str
) -> Callable[[int, int], tuple[nn.Module, int]]:
    def build(layer: int, expert: int) -> tuple[nn.Module, int]:
        with torch.device("meta"):
            module = Expert(cfg.hidden_size, cfg.moe_intermediate_size, swiglu_limit=cfg.swiglu_limit)
        nbytes = 0
        for part in ("w1", "w2", "w3"):
            lin = getattr(module, part)
            w = ckpt.tensors[f"layers.{layer}.ffn.experts.{expert}.{part}.weight"]
            s = ckpt.tensors.get(f"layers.{layer}.ffn.experts.{expert}.{part}.scale")
            edge = _edge(lin, s, block)
            weight, scale = _read_linear(ckpt, w, s, edge, numerics)
            lin.set_weight(weight, scale, block=edge)
            nbytes += weight.numel() * weight.element_size() + (0 if scale is None else scale.numel())
        return module.eval(), nbytes

    return build


def _count_linears(model: nn.Module) -> dict[str, int]:
    counts = {"dense": 0, "fp8": 0, "fp4": 0}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type != "meta":
            counts[module.storage] += 1
    return counts


def _quantization_config(ckpt: Checkpoint) -> dict | None:
    if ckpt.config_path is None:
        return None
    try:
        quant = json.loads(ckpt.config_path.read_text()).get("quantization_config")
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"{ckpt.config_path} is not JSON: {exc}") from exc
    return quant if isinstance(quant, dict) else None


def _block(ckpt: Checkpoint) -> int | None:
    quant = _quantization_config(ckpt) or {}
    edges = quant.get("weight_block_size")
    if isinstance(edges, list) and len(edges) == 2 and edges[0] == edges[1] and isinstance(edges[0], int):
        return edges[0]
    return None


def _has_quantized(ckpt: Checkpoint) -> bool:
    return any(_storage_of(t) in ("fp8", "fp4") for n, t in ckpt.tensors.items() if n.endswith(".weight"))


def _headers_digest(ckpt: Checkpoint) -> str:
    """SHA-256 of every tensor's name, dtype, shape, place and its file's size and mtime: the identity of
    a checkpoint too large to hash byte by byte (part of the model fingerprint)."""
    h = hashlib.sha256()
    for name in sorted(ckpt.tensors):
        t = ckpt.tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape}:{t.file.name}:{t.offset}:{t.nbytes};".encode())
    for file in sorted({t.file for t in ckpt.tensors.values()}):
        st = file.stat()
        h.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()
