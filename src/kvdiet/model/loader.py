"""Weights to and from safetensors files, under DeepSeek's reference tensor names.

The model's module tree is laid out so that ``state_dict()`` names are DeepSeek's checkpoint names (no
``model.`` prefix), for example::

    embed.weight                          head.weight            norm.weight
    layers.{i}.attn_norm.weight           layers.{i}.ffn_norm.weight
    layers.{i}.hc_attn_fn / hc_attn_base / hc_attn_scale   (and hc_ffn_*)
    layers.{i}.attn.wq_a.weight  .q_norm.weight  .wq_b.weight  .wkv.weight  .kv_norm.weight
    layers.{i}.attn.wo_a.weight  .wo_b.weight  .attn_sink
    layers.{i}.attn.compressor.wkv.weight  .wgate.weight (ratio > 1)  .norm.weight      (Full layers)
    layers.{i}.attn.indexer.wq_b.weight  .weights_proj.weight  [.wk.weight  .k_norm.weight (Full)]
    layers.{i}.ffn.gate.weight  .gate.bias  .experts.{e}.w1/w2/w3.weight  .shared_experts.w1/w2/w3.weight
    layers.{i}.engram.embed.weight  .embed.scale  .wkv.weight  .q_weight  .k_weight   (Engram layers)

Sources: DeepSeek's ``inference/model.py`` naming as mapped by public converters (v41-spec §1.2 census).
A checkpoint's FP8 linear (``X.weight`` in float8_e4m3fn with ``X.scale``, one scale per
``block × block`` tile) is dequantised on load; other dtypes are cast to the parameter's dtype. FP4 expert
tensors are not supported (clear error). Sharded checkpoints with ``model.safetensors.index.json`` load too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = ["WeightsError", "load_weights", "save_weights"]

_INDEX = "model.safetensors.index.json"


class WeightsError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or mis-shaped tensors (all named)."""


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Write every parameter and buffer of ``model`` to one safetensors file (contiguous CPU tensors)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(out), metadata={"format": "pt", "writer": "kvdiet"})
    return out


def load_weights(model: nn.Module, path: str | Path, *, block: int = 32) -> None:
    """Load a file or a sharded checkpoint folder into ``model`` (strict, all-or-nothing).

    Args:
        model: the module to fill; its ``state_dict`` names are the expected tensor names.
        path: a ``.safetensors`` file, or a folder with one file or with ``model.safetensors.index.json``.
        block: FP8 scale tile size (config ``quantization_config.weight_block_size``; 32 for V4.1).
    Raises:
        WeightsError: a missing tensor, an unexpected one, a shape mismatch or an unsupported dtype; the
            message names every offending tensor and nothing is loaded.
        FileNotFoundError: no checkpoint at ``path``.
    """
    files = _files(Path(path))
    expected = model.state_dict()
    found: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
            raise WeightsError(f"{file} is not a valid safetensors file: {exc}") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(name)
                if name.endswith(".scale") and name not in expected:
                    scales[name[: -len(".scale")]] = tensor
                else:
                    found[name] = tensor
    problems = [
        f"missing tensor {name} {tuple(t.shape)}" for name, t in expected.items() if name not in found
    ]
    problems += [f"unexpected tensor {name}" for name in found if name not in expected]
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in found.items():
        if name not in expected:
            continue
        target = expected[name]
        value = _dequantize(name, tensor, scales, block, problems)
        if value is not None and tuple(value.shape) != tuple(target.shape):
            problems.append(
                f"tensor {name} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}"
            )
        elif value is not None:
            ready[name] = value.to(target.dtype)
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise WeightsError(
            f"checkpoint {path} does not fit the model ({len(problems)} problems):\n  " + "\n  ".join(shown)
        )
    model.load_state_dict(ready, strict=True)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        return sorted({path / shard for shard in index["weight_map"].values()})
    shards = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not shards:
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    return shards


def _dequantize(
    name: str, tensor: torch.Tensor, scales: dict[str, torch.Tensor], block: int, problems: list[str]
) -> torch.Tensor | None:
    if tensor.dtype == torch.float8_e4m3fn:
        scale = scales.get(name[: -len(".weight")] if name.endswith(".weight") else name)
        if scale is None:
            problems.append(f"tensor {name} is FP8 but has no .scale")
            return None
        scale = scale.float()
        rows, cols = tensor.shape
        tiles = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        return tensor.float() * tiles
    if tensor.dtype in (torch.int8, torch.uint8) and not name.endswith(("embed.weight", "embed.scale")):
        problems.append(f"tensor {name} has packed dtype {tensor.dtype} (FP4 experts are not supported)")
        return None
    return tensor
