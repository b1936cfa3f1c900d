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

What each stored form becomes (FP8/FP4/dense `Linear`, FP8 Engram table, fp32 tensor) and how the tensors are
matched to the model: `kvdiet.model.load_plan`.

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
from kvdiet.model.checkpoint import ROUTED_EXPERT, Checkpoint, WeightsError
from kvdiet.model.expert_cache import ExpertCache
from kvdiet.model.linear import ACT_BLOCK, Linear
from kvdiet.model.load_plan import LinearStep, TableStep, match_tensors, read_linear, storage_of, tile_edge
from kvdiet.model.memory import available_memory_bytes, check_fits, checkpoint_footprint
from kvdiet.model.moe import Expert
from kvdiet.model.transformer import Transformer
from kvdiet.setting_error import ConfigSettingError

__all__ = [
    "NUMERICS",
    "LoadReport",
    "WeightsError",
    "load_checkpoint",
    "load_weights",
    "resolve_numerics",
    "save_weights",
]


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
    plan = match_tensors(model, ckpt, block=_block(ckpt), lazy_experts=False)
    _check_activation_blocks(model.cfg, ckpt, plan, chosen)  # before reading any tensor
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
    plan = match_tensors(model, ckpt, block=block, lazy_experts=True)
    _check_activation_blocks(config, ckpt, plan, chosen)
    row_tables = []
    for step in plan:
        if (
            isinstance(step, TableStep)
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
            linears[storage_of(info)] += 1
    report = LoadReport(chosen, linears, len(ckpt.skipped), True, tuple(row_tables), ckpt.nbytes, cache)
    model.weights_digest = _headers_digest(ckpt)
    return model.eval(), report


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
            edge = tile_edge(lin, s, block)
            weight, scale = read_linear(ckpt, w, s, edge, numerics)
            lin.set_weight(weight, scale, block=edge)
            nbytes += weight.numel() * weight.element_size() + (0 if scale is None else scale.numel())
        return module.eval(), nbytes

    return build


def _check_activation_blocks(cfg: ModelConfig, ckpt: Checkpoint, plan: list, numerics: str) -> None:
    """Under fp8 numerics every FP8/FP4 linear quantises its input in blocks of `ACT_BLOCK` (the reference's
    ``act_quant``, which asserts whole blocks): each such linear's ``in_features`` must be a multiple of it.

    Raises:
        ConfigSettingError (a ConfigError): naming the first linear that is not, its width and the way out
            (bf16 numerics, spelled as the caller's keyword or flag: `kvdiet.setting_error`).
    """
    if numerics != "fp8":
        return
    widths = [
        (step.weight.name, step.module.in_features)
        for step in plan
        if isinstance(step, LinearStep) and storage_of(step.weight) != "dense"
    ]
    expert_in = {"w1": cfg.hidden_size, "w3": cfg.hidden_size, "w2": cfg.moe_intermediate_size}
    for name, info in ckpt.tensors.items():
        if name.endswith(".weight") and ROUTED_EXPERT.match(name) and storage_of(info) != "dense":
            widths.append((name, expert_in[name.split(".")[-2]]))
    for name, width in widths:
        if width % ACT_BLOCK:
            raise ConfigSettingError(
                f"{name} takes {width} inputs, not a multiple of {ACT_BLOCK}: fp8 numerics quantise a quantised "
                f"linear's input in blocks of {ACT_BLOCK}; load with {{numerics=bf16}} or use whole blocks"
            )


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
    return any(storage_of(t) in ("fp8", "fp4") for n, t in ckpt.tensors.items() if n.endswith(".weight"))


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
