"""The Engram compressed-token map of a checkpoint folder: where a model without a tokenizer finds it.

Engram hashes compressed token ids (v41-spec §8.3a): a map token id → compressed id that the tokenizer's
vocabulary defines (`kvdiet.model.engram_hash.compressed_token_map`). A config whose
``engram_compressed_vocab_size`` differs from its ``vocab_size`` cannot run without one. `kvdiet.model.build`
takes it, in this order, from the folder's ``tokenizer.json``; from ``engram_token_map.safetensors``
(`TOKEN_MAP_FILE`: one tensor ``engram.token_map``, int64 [vocab_size], every compressed id in
``[0, engram_compressed_vocab_size)`` used; `write_random_checkpoint` writes the placeholder it used,
`save_token_map` any other); from a golden folder's ``reference_outputs.safetensors`` when it holds
``engram.token_map`` (the map the reference ran with); then from DeepSeek's tokenizer for its vocabulary.
The stored weights never depend on the map; only the hashing does.

This module reads and writes the files; it knows nothing of tokenizers or models.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvdiet.config import ModelConfig

__all__ = [
    "NOT_WEIGHTS",
    "REFERENCE_OUTPUTS_FILE",
    "TOKEN_MAP_FILE",
    "TOKEN_MAP_TENSOR",
    "find_token_map",
    "needs_token_map",
    "placeholder_token_map",
    "save_token_map",
]

TOKEN_MAP_FILE = "engram_token_map.safetensors"
TOKEN_MAP_TENSOR = "engram.token_map"
REFERENCE_OUTPUTS_FILE = "reference_outputs.safetensors"  # kvdiet.model.golden's reference dump
NOT_WEIGHTS = (REFERENCE_OUTPUTS_FILE, TOKEN_MAP_FILE)
"""The ``*.safetensors`` files of a checkpoint folder that are not weights (`kvdiet.model.checkpoint`)."""


def needs_token_map(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` runs only with a compressed-token map: it has Engram layers and its
    ``engram_compressed_vocab_size`` is not its ``vocab_size`` (equal sizes take the identity)."""
    return bool(cfg.engram_layer_ids) and cfg.engram_compressed_vocab_size != cfg.vocab_size


def placeholder_token_map(cfg: ModelConfig) -> torch.Tensor | None:
    """A map using every one of the ``engram_compressed_vocab_size`` (C) ids, token i → i·C // V (int64 [V]),
    for weights made without a tokenizer (random ones); None where the config needs none (`needs_token_map`)."""
    if not needs_token_map(cfg):
        return None
    return (
        torch.arange(cfg.vocab_size, dtype=torch.int64) * cfg.engram_compressed_vocab_size // cfg.vocab_size
    )


def save_token_map(folder: str | Path, token_map: torch.Tensor) -> Path:
    """Write ``token_map`` (integer [vocab_size]) as ``folder/engram_token_map.safetensors`` (int64); returns
    the file's path. Checked against the config when a model is built with it, not here.

    Raises:
        ValueError: ``token_map`` is not a 1-D integer tensor.
    """
    if token_map.ndim != 1 or token_map.dtype.is_floating_point or token_map.dtype == torch.bool:
        raise ValueError(f"a token map is 1-D integers, got {token_map.dtype} {tuple(token_map.shape)}")
    path = Path(folder) / TOKEN_MAP_FILE
    save_file({TOKEN_MAP_TENSOR: token_map.to("cpu", torch.int64).contiguous()}, str(path))
    return path


def find_token_map(folder: str | Path) -> tuple[torch.Tensor, Path] | None:
    """The map stored in ``folder`` and the file it came from: ``engram_token_map.safetensors``, else a
    ``reference_outputs.safetensors`` holding ``engram.token_map``; None when neither has one.

    Raises:
        ValueError: ``engram_token_map.safetensors`` is not a readable safetensors file holding
            ``engram.token_map``.
    """
    folder = Path(folder)
    stored = folder / TOKEN_MAP_FILE
    if stored.is_file():
        found = _read(stored)
        if found is None:
            raise ValueError(f"{stored} holds no {TOKEN_MAP_TENSOR} tensor")
        return found, stored
    outputs = folder / REFERENCE_OUTPUTS_FILE
    if outputs.is_file():
        found = _read(outputs)
        if found is not None:
            return found, outputs
    return None


def _read(path: Path) -> torch.Tensor | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(TOKEN_MAP_TENSOR) if TOKEN_MAP_TENSOR in f.keys() else None  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
        raise ValueError(f"{path} is not a readable safetensors file (damaged or truncated?): {exc}") from exc
