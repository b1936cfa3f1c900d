"""Model configurations, read once from Hugging Face ``config.json`` files and frozen.

Two kinds:
- `ModelConfig`: the DeepSeek-V4 family (``model_type`` ``deepseek_v41`` / ``deepseek_v41_text`` for V4.1,
  ``deepseek_v4`` for the V4-Flash baseline). Field names equal the JSON keys, so a field can be looked up
  in the file by its name. A V4.1 file keeps the text model under ``text_config``; its keys win over the
  top level's.
- `DenseConfig`: a plain attention model (MHA/GQA, or MLA with ``kv_lora_rank``), used only as a
  byte-count baseline by the planner (e.g. DeepSeek-LLM-67B).

`load_config` resolves a preset name (``v4.1-mini``, ``deepseek-v4.1-flash``, …) or a path. Validation
errors are `ConfigError` (a ``ValueError``) naming the field and the bad value; the checks of a
`ModelConfig`'s values are `kvdiet.config_validation`. This module knows nothing of roles or bytes:
`kvdiet.layer_plan` derives roles, `kvdiet.cache.spec` derives bytes.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from kvdiet.config_validation import ConfigError, no_config, validate_model_config

__all__ = [
    "NUMERICS",
    "PRESETS",
    "ConfigError",
    "DenseConfig",
    "ModelConfig",
    "RopeScaling",
    "config_dir",
    "load_config",
    "model_config_path",
]

_MAX_INT = 1 << 53  # the largest integer field a config may give (exact as a float too)

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
V4_MODEL_TYPES = ("deepseek_v4",)


NUMERICS = ("auto", "fp8", "bf16")
"""How weights stored FP8/FP4 compute (``--numerics``; `kvdiet.model.loader` documents each)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """YaRN parameters (config field ``rope_scaling``; V4 files spell ``rope_type`` as ``type``)."""

    rope_type: str
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A DeepSeek-V4-family text model. Field names are the HF JSON keys (v41-spec §1.1, §1.3).

    Fields absent from a file are ``None`` (V4 files have no ``kv_source_layer_ids``; V4.1 files have no
    ``num_hash_layers``). ``compress_ratios`` has one entry per layer plus trailing entries for the
    DSpark/MTP blocks, which are not transformer layers.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rope_scaling: RopeScaling | None = None
    topk_method: str | None = None
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    engram_layer_ids: tuple[int, ...] | None = None
    engram_num_embeddings: tuple[int, ...] | None = None
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_pad_token_id: int | None = None
    engram_compressed_vocab_size: int | None = None
    num_hash_layers: int | None = None
    num_nextn_predict_layers: int | None = None
    dspark_block_size: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name: str = ""

    @property
    def is_v41(self) -> bool:
        """True for V4.1 (CSA2 with shared KV sources), False for the V4 baseline."""
        return self.model_type in V41_MODEL_TYPES

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """``compress_ratios`` of the transformer layers only (the first ``num_hidden_layers`` entries)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @classmethod
    def from_hf_json(cls, path: str | Path, *, name: str | None = None) -> ModelConfig:
        """Read and validate a HF ``config.json`` (top level or ``text_config``).

        Raises:
            ConfigError: unreadable file, unsupported ``model_type``, a missing, mistyped or invalid field.
        """
        data = _read_json(path)
        flat = _flatten_text_config(data)
        model_type = flat.get("model_type")
        if model_type not in V41_MODEL_TYPES + V4_MODEL_TYPES:
            raise ConfigError(f"{path}: model_type {model_type!r} is not a DeepSeek-V4-family model")
        flat["name"] = name if name is not None else Path(path).stem
        return cls.from_dict(flat)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from an already flattened dict of JSON fields; unknown keys are ignored."""
        cfg = cls(**_coerce_fields(cls, data))
        validate_model_config(cfg)
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as flat HF-style JSON fields (what `from_dict` reads back; ``name`` left out)."""
        out = _as_json_dict(self)
        out.pop("name", None)
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed (the way presets and tests derive configs)."""
        return ModelConfig.from_dict({**_as_json_dict(self), **changes})


@dataclass(frozen=True, slots=True)
class DenseConfig:
    """A dense-attention baseline: every layer keeps K and V for every token (or one MLA latent).

    ``kv_lora_rank`` set means MLA (DeepSeek-V2/V3): one latent of ``kv_lora_rank + qk_rope_head_dim``
    values per layer and token; otherwise MHA/GQA with ``num_key_value_heads`` heads of ``head_dim``
    (default ``hidden_size // num_attention_heads``) for K and for V. Values are bf16.
    """

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    name: str = ""

    @property
    def kv_heads(self) -> int:
        """KV heads (``num_key_value_heads``, MHA when absent)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def kv_head_dim(self) -> int:
        """Per-head dim of K and V."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_json(cls, path: str | Path, *, name: str | None = None) -> DenseConfig:
        """Read a dense model's HF ``config.json``.

        Raises:
            ConfigError: unreadable file or a missing/mistyped field.
        """
        flat = _flatten_text_config(_read_json(path))
        flat["name"] = name if name is not None else Path(path).stem
        cfg = cls(**_coerce_fields(cls, flat))
        for field in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
            if getattr(cfg, field) <= 0:
                raise ConfigError(f"{field} must be > 0, got {getattr(cfg, field)}")
        if cfg.kv_lora_rank is not None and cfg.qk_rope_head_dim is None:
            raise ConfigError("kv_lora_rank is set (MLA) but qk_rope_head_dim is missing")
        return cfg


# Preset name -> file in configs/. Real configs keep their HF bytes; mini/micro are written for kvdiet.
PRESETS: dict[str, str] = {
    "deepseek-v4.1-flash": "deepseek-v4.1-flash.json",
    "deepseek-v4-flash": "deepseek-v4-flash-0731.json",
    "v4.1-mini": "v4.1-mini.json",
    "v4.1-micro": "v4.1-micro.json",
    "v4-mini": "v4-mini.json",
    "deepseek-llm-67b": "deepseek-llm-67b.json",
}


def config_dir() -> Path:
    """The folder holding the shipped configs (inside the wheel, or the repo's ``configs/``)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parents[1] / "configs"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"no configs folder found next to {here}")


def model_config_path(weights: str | Path | None) -> Path | None:
    """The ``config.json`` beside a checkpoint (a folder holding it, or a file next to it), or None."""
    if weights is None:
        return None
    path = Path(weights)
    found = path / "config.json" if path.is_dir() else path.parent / "config.json"
    return found if found.is_file() else None


def load_config(name_or_path: str | Path) -> ModelConfig | DenseConfig:
    """Load a preset by name or a config file by path; V4-family files give `ModelConfig`, others `DenseConfig`.

    Raises:
        ConfigError: unknown preset and no such file, or an invalid config (a file's named first).
    """
    text = str(name_or_path)
    if text in PRESETS:
        path, name = config_dir() / PRESETS[text], text
    else:
        path, name = Path(text), None
        if not path.is_file():
            raise no_config(text, list(PRESETS))
    model_type = _flatten_text_config(_read_json(path)).get("model_type")
    kind = ModelConfig if model_type in V41_MODEL_TYPES + V4_MODEL_TYPES else DenseConfig
    try:
        return kind.from_hf_json(path, name=name)
    except ConfigError as exc:  # a file's field: the file named (``plan --compare A B``: which of the two)
        if name is not None or str(path) in str(exc):
            raise
        raise ConfigError(f"{path}: {exc}") from None


_CONFIG_BYTES_MAX = 1 << 24  # a config.json is kilobytes; a larger file is not one (read no further)


def _read_json(path: str | Path) -> dict[str, Any]:
    bom = 0
    try:
        with Path(path).open("rb") as f:
            raw = f.read(_CONFIG_BYTES_MAX + 1)
        if len(raw) > _CONFIG_BYTES_MAX:
            raise ConfigError(f"{path}: over {_CONFIG_BYTES_MAX:,} bytes, not a config file")
        bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark is dropped
        data = json.loads(raw[bom:].decode("utf-8"))
    except UnicodeDecodeError as exc:  # the offset in the file, past any byte-order mark
        raise ConfigError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start + bom}), not a config file"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deep, not a config file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except ConfigError:  # over the size cap, named already
        raise
    except ValueError:  # json.loads' bare ValueError: an integer literal past Python's digit limit
        raise ConfigError(
            f"{path}: an integer of more than {sys.get_int_max_str_digits():,} digits, not a config file"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    return data


def _flatten_text_config(data: dict[str, Any]) -> dict[str, Any]:
    text = data.get("text_config")
    flat = {k: v for k, v in data.items() if k != "text_config"}
    if isinstance(text, dict):
        flat.update(text)
    return flat


def _coerce_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Type-check the JSON values for ``cls``'s fields; missing required fields raise."""
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in data or data[field.name] is None:
            if field.default is dataclasses.MISSING:
                raise ConfigError(f"missing required field {field.name!r}")
            continue
        out[field.name] = _coerce(field.name, data[field.name], hints[field.name])
    return out


def _coerce(name: str, value: Any, hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    if hint is RopeScaling:
        return _rope_scaling(value)
    if get_origin(hint) is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list of integers, got {_shown(value)}")
        return tuple(_integer(f"{name}[{i}]", item) for i, item in enumerate(value))
    if hint is int:
        return _integer(name, value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} must be a number, got {_shown(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer past a float's range
            raise ConfigError(
                f"{name} must be a number within a float's range, got {_shown(value)}"
            ) from None
        if not math.isfinite(number):  # JSON's NaN / Infinity, which Python's reader takes
            raise ConfigError(f"{name} must be a finite number, got {json.dumps(number)}")
        return number
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    raise TypeError(f"unhandled field type {hint} for {name}")


def _integer(name: str, value: Any) -> int:
    """``value`` where it is an integer of at most 2^53 in size, else ConfigError naming ``name``."""
    if not _is_int(value):
        raise ConfigError(f"{name} must be an integer, got {_shown(value)}")
    if abs(value) > _MAX_INT:
        raise ConfigError(f"{name} must be at most 2^53 in size, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """``repr(value)``, but an integer of more than 30 digits by its size (its digits would fill the screen)."""
    if _is_int(value) and value.bit_length() > 100:
        return f"an integer of some {int(value.bit_length() * 0.30103)} digits"
    return repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rope_scaling(value: Any) -> RopeScaling:
    if not isinstance(value, dict):
        raise ConfigError(f"rope_scaling must be an object, got {value!r}")
    value = {**value}
    if "type" in value and "rope_type" not in value:
        value["rope_type"] = value.pop("type")
    scaling = RopeScaling(**_coerce_fields(RopeScaling, value))
    if scaling.rope_type != "yarn":
        raise ConfigError(f"rope_scaling.rope_type must be 'yarn', got {scaling.rope_type!r}")
    return scaling


def _as_json_dict(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, RopeScaling):
            value = dataclasses.asdict(value)
        out[field.name] = value
    return out
