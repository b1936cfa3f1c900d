"""`load_model`: a V4.1 or V4-Flash model and its tokenizer from a preset, a config path or a checkpoint.

The one place that turns a model name (and optionally a weights folder) into a `Transformer` (or a
`kvdiet.model.v4.V4Transformer` for a V4-Flash config): seeded random weights, or (V4.1) the released
checkpoint through `kvdiet.model.loader.load_checkpoint`. It knows nothing of
caches, engines or servers; those call it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvdiet.config import ConfigError, ModelConfig, load_config, model_config_path
from kvdiet.device import check_device
from kvdiet.formats import native
from kvdiet.model.checkpoint_token_map import (
    TOKEN_MAP_FILE,
    find_token_map,
    needs_token_map,
    placeholder_token_map,
)
from kvdiet.model.engram_hash import check_token_map, compressed_token_map
from kvdiet.model.loader import load_checkpoint
from kvdiet.model.placement import place
from kvdiet.model.transformer import Transformer
from kvdiet.model.v4 import V4Transformer
from kvdiet.model.weight_arena import pack_weights
from kvdiet.setting_error import ConfigSettingError
from kvdiet.tokenizer import Tokenizer

__all__ = ["check_numerics", "load_model"]


def check_numerics(numerics: str, weights: str | Path | None) -> None:
    """Refuse ``numerics="fp8"`` without ``weights``: random weights are dense fp32, with no FP8 linear to run
    (`load_model` and `kvdiet.engine.args.EngineArgs.validate`, before anything loads).

    Raises:
        ConfigSettingError: as above.
    """
    if numerics == "fp8" and weights is None:
        raise ConfigSettingError("{numerics=fp8} goes with {weights} (random weights are always bf16)")


def load_model(
    name_or_path: str | None,
    *,
    seed: int = 0,
    weights: str | Path | None = None,
    exact: bool = False,
    numerics: str = "auto",
    expert_cache_bytes: int | None = None,
    device: str = "cpu",
    pack: bool = True,
) -> tuple[Transformer | V4Transformer, Tokenizer | None]:
    """A V4.1 model (seeded random weights, or a checkpoint) or a V4-Flash model (seeded random weights) and
    its tokenizer.

    With ``weights`` the model is built from the checkpoint (`kvdiet.model.loader.load_checkpoint`: routed
    experts read on first use, resident memory far below the checkpoint's size); its config is
    ``name_or_path`` or, when that is None, the ``config.json`` beside the weights. The load report is kept
    as ``model.load_report``. The model is built on the host and placed on ``device`` (``cpu``, ``cuda``,
    ``cuda:N``; `kvdiet.model.placement.place`). The tokenizer is the checkpoint's ``tokenizer.json`` when it
    has one, else the real DeepSeek tokenizer for configs of its vocabulary size (129,280); smaller test
    configs get none (prompts are then token ids). An Engram config's compressed-token map comes from the
    checkpoint folder or the tokenizer (`_engram_token_map`; `kvdiet.model.checkpoint_token_map`).

    Raises:
        ConfigError: not a DeepSeek-V4-family config, no config at all, a given config whose widths differ
            from the ``config.json`` beside the weights (both named), V4-Flash with ``weights`` (its
            released checkpoint does not load yet), or a checkpoint whose Engram map is nowhere to be found or
            whose stored map does not fit the config (the file named).
        kvdiet.model.loader.WeightsError: the weights do not fit the config.
        kvdiet.model.memory.InsufficientMemoryError: the model cannot fit in memory (before any allocation).
        ValueError: a device other than the CPU for a V4-Flash model or without CUDA (`kvdiet.device`);
            ``numerics="fp8"`` without ``weights`` (a `kvdiet.setting_error.ConfigSettingError`).

    On the CPU the compiled kernels are loaded here (built on a machine's first use, about a minute), so the
    first forward's time is the forward's, and (unless ``pack`` is False: a benchmark's baseline) a V4.1 model's
    parameters are packed in the order a decode step reads them (`kvdiet.model.weight_arena.pack_weights`: the
    same values).
    """
    check_device(device)
    check_numerics(numerics, weights)
    if device == "cpu":
        native.fp4_kernels()
    if name_or_path is None:
        found = model_config_path(weights)
        if found is None:
            raise ConfigSettingError(
                "no config.json beside the weights {weights}; give the config as {model}", weights=weights
            )
        name_or_path = str(found)
    cfg = load_config(name_or_path)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(
            f"{name_or_path!r} is not a DeepSeek-V4-family config (a dense baseline has no model)"
        )
    _check_beside(cfg, name_or_path, weights)
    tokenizer = _tokenizer_for(cfg, weights)
    if not cfg.is_v41:
        if weights is not None:
            raise ConfigError(
                f"{name_or_path!r} is V4-Flash: its checkpoint does not load yet (random weights only)"
            )
        model = V4Transformer.from_config(cfg, seed=seed, exact=exact)
        return place(model, device), tokenizer
    token_map = _engram_token_map(cfg, weights, tokenizer) if cfg.engram_layer_ids else None
    if weights is None:
        model = Transformer.from_config(cfg, seed=seed, exact=exact, token_map=token_map)
        model.load_report = None
    else:
        model, report = load_checkpoint(
            weights,
            config=cfg,
            token_map=token_map,
            numerics=numerics,
            exact=exact,
            expert_cache_bytes=expert_cache_bytes,
        )
        model.load_report = report
    # the weights in decode-read order on huge pages: the same values, read faster
    if pack and device == "cpu":
        pack_weights(model)
    return place(model, device), tokenizer


def _folder(weights: str | Path | None) -> Path | None:
    """The checkpoint folder of ``weights`` (a folder, or a file in one)."""
    return None if weights is None else (Path(weights) if Path(weights).is_dir() else Path(weights).parent)


def _tokenizer_for(cfg: ModelConfig, weights: str | Path | None) -> Tokenizer | None:
    """The checkpoint's own ``tokenizer.json`` when it has one, else DeepSeek's for its vocabulary size."""
    folder = _folder(weights)
    if folder is not None and (folder / "tokenizer.json").is_file():
        return Tokenizer(folder / "tokenizer.json")
    return Tokenizer.deepseek() if cfg.vocab_size == 129_280 else None


def _engram_token_map(
    cfg: ModelConfig, weights: str | Path | None, tokenizer: Tokenizer | None
) -> torch.Tensor | None:
    """The Engram compressed-token map (int64 [vocab_size]) in `kvdiet.model.checkpoint_token_map`'s order:
    the checkpoint's ``tokenizer.json``, its stored map, then DeepSeek's tokenizer for its vocabulary; random
    weights without a tokenizer take the placeholder `write_random_checkpoint` writes; None where the config
    needs no map (``engram_compressed_vocab_size`` = ``vocab_size``: the identity).

    Raises:
        ConfigError: a checkpoint needing a map, with no tokenizer and no stored map (what to add is named), or
            a stored map that does not fit the config (`check_token_map`; the file named).
        ValueError: a damaged ``engram_token_map.safetensors``.
    """
    folder = _folder(weights)
    own_tokenizer = folder is not None and (folder / "tokenizer.json").is_file()
    if not own_tokenizer and folder is not None and (found := find_token_map(folder)) is not None:
        token_map, path = found
        try:
            return check_token_map(cfg, token_map)
        except ValueError as exc:  # a map left from other weights, or written by hand
            raise ConfigError(
                f"{path}: {exc}: the stored Engram map is not this config's (engram_compressed_vocab_size "
                f"{cfg.engram_compressed_vocab_size:,}, vocab_size {cfg.vocab_size:,}); write the model's map with "
                f"kvdiet.model.checkpoint_token_map.save_token_map, or add its tokenizer.json"
            ) from None
    if tokenizer is not None:
        return compressed_token_map(tokenizer)[0]
    if weights is None:
        return placeholder_token_map(cfg)
    if not needs_token_map(cfg):
        return None
    raise ConfigError(
        f"{weights}: Engram needs a compressed-token map (engram_compressed_vocab_size "
        f"{cfg.engram_compressed_vocab_size:,} != vocab_size {cfg.vocab_size:,}, not DeepSeek's vocabulary) and "
        f"the folder has none: add the model's tokenizer.json, or the map as {TOKEN_MAP_FILE} (tensor "
        f"engram.token_map, int64 [{cfg.vocab_size}]; kvdiet.model.checkpoint_token_map.save_token_map)"
    )


def _check_beside(cfg: ModelConfig, name: str, weights: str | Path | None) -> None:
    """A config given with ``weights`` must have the widths of the ``config.json`` beside them, where there is
    one: else every tensor, or the Engram map, would be refused one by one in terms of the wrong config.

    Raises:
        ConfigSettingError: the first differing field, both values, naming the setting (``model`` / ``--model``).
    """
    beside = model_config_path(weights) if weights is not None else None
    if beside is None or Path(name).resolve() == Path(beside).resolve():
        return
    theirs = load_config(str(beside))
    if not isinstance(theirs, ModelConfig):
        return  # the loader refuses it in its own words
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
    for field in fields:
        mine, got = getattr(cfg, field), getattr(theirs, field)
        if mine != got:
            raise ConfigSettingError(
                "{model} {name} has {field} {mine} but the checkpoint's {beside} has {got}: leave {model} "
                "out to run the checkpoint's own config",
                name=repr(name),
                field=field,
                mine=mine,
                beside=beside,
                got=got,
            )
