"""Where a checkpoint's Engram compressed-token map comes from without a tokenizer: the writer's stored map,
a golden folder's reference outputs, or a refusal that names what to add (`kvdiet.model.checkpoint_token_map`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvdiet.config import ConfigError, load_config
from kvdiet.model.build import load_model
from kvdiet.model.checkpoint_token_map import TOKEN_MAP_FILE, placeholder_token_map, save_token_map
from kvdiet.model.export import save_checkpoint, write_random_checkpoint
from kvdiet.model.loader import load_checkpoint
from kvdiet.model.transformer import Transformer

PROMPT = [3, 9, 27, 17, 51, 25, 11, 33, 2, 6]


@pytest.fixture(scope="module")
def cfg():
    """v4.1-micro with 40 compressed ids for its 64 tokens: Engram needs a map, and the vocabulary is not
    DeepSeek's (no tokenizer)."""
    return load_config("v4.1-micro").replace(engram_compressed_vocab_size=40)


def _logits(model: Transformer) -> torch.Tensor:
    return model.prefill(model.new_state(), PROMPT, all_logits=True)


def test_a_random_checkpoint_stores_its_map_and_loads_without_a_tokenizer(tmp_path: Path, cfg) -> None:
    write_random_checkpoint(cfg, tmp_path, seed=1)
    stored = load_file(str(tmp_path / TOKEN_MAP_FILE))["engram.token_map"]
    want = torch.arange(64) * 40 // 64
    assert stored.dtype == torch.int64 and torch.equal(stored, want)
    model, tokenizer = load_model(None, weights=tmp_path)
    assert tokenizer is None and torch.equal(model.hasher.token_map, want)
    direct, _ = load_checkpoint(tmp_path, token_map=want)
    assert torch.equal(_logits(model), _logits(direct))
    other, _ = load_checkpoint(tmp_path, token_map=torch.arange(64) % 40)
    assert not torch.equal(_logits(model), _logits(other))  # the map matters: the right one was taken


def test_a_folder_without_a_map_is_refused_naming_what_to_add(tmp_path: Path, cfg) -> None:
    write_random_checkpoint(cfg, tmp_path, seed=1)
    (tmp_path / TOKEN_MAP_FILE).unlink()
    with pytest.raises(ConfigError) as err:
        load_model(None, weights=tmp_path)
    assert "add the model's tokenizer.json, or the map as engram_token_map.safetensors" in str(err.value)
    assert "engram_compressed_vocab_size 40 != vocab_size 64" in str(err.value)


def test_the_stored_map_comes_before_the_reference_outputs_map(tmp_path: Path, cfg) -> None:
    """A golden folder's ``reference_outputs.safetensors`` gives its ``engram.token_map`` when the checkpoint
    stores none (as `kvdiet golden` reads it); a stored map comes first."""
    write_random_checkpoint(cfg, tmp_path, seed=1)
    (tmp_path / TOKEN_MAP_FILE).unlink()
    reference = torch.arange(64) % 40
    save_file(
        {"prompt_tokens": torch.tensor(PROMPT), "engram.token_map": reference},
        str(tmp_path / "reference_outputs.safetensors"),
    )
    model, _ = load_model(None, weights=tmp_path)
    assert torch.equal(model.hasher.token_map, reference)
    own = (torch.arange(64) * 7) % 40
    save_token_map(tmp_path, own)
    model, _ = load_model(None, weights=tmp_path)
    assert torch.equal(model.hasher.token_map, own)


def test_a_saved_model_keeps_its_own_map(tmp_path: Path, cfg) -> None:
    token_map = (torch.arange(64) * 3) % 40
    model = Transformer.from_config(cfg, seed=2, token_map=token_map)
    save_checkpoint(model, tmp_path)
    loaded, _ = load_model(None, weights=tmp_path, numerics="bf16")
    assert torch.equal(loaded.hasher.token_map, token_map)


def test_random_weights_without_a_tokenizer_take_the_placeholder_map(tmp_path: Path, cfg) -> None:
    """``--model config.json`` alone (random weights): the map `write_random_checkpoint` would store, where
    a refusal once said to build one in Python."""
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json_dict()))
    model, tokenizer = load_model(str(tmp_path / "config.json"), seed=0)
    assert tokenizer is None and torch.equal(model.hasher.token_map, torch.arange(64) * 40 // 64)
    assert torch.equal(placeholder_token_map(cfg), torch.arange(64) * 40 // 64)
    assert placeholder_token_map(load_config("v4.1-micro")) is None  # 64 compressed ids: the identity


def test_rewriting_a_folder_for_a_config_without_a_map_drops_the_old_map(tmp_path: Path, cfg) -> None:
    write_random_checkpoint(cfg, tmp_path, seed=1)
    write_random_checkpoint(load_config("v4.1-micro"), tmp_path, seed=1)
    assert not (tmp_path / TOKEN_MAP_FILE).exists()


@pytest.mark.parametrize(
    ("stored", "fault"),
    [
        (torch.arange(65) * 40 // 65, r"token map has shape \(65,\), expected \(64,\)"),  # another vocabulary
        ((torch.arange(64) * 40 // 64).view(8, 8), r"token map has shape \(8, 8\)"),
        (torch.arange(64) % 50, "token map has 50 compressed ids but engram_compressed_vocab_size is 40"),
        (torch.arange(64) * 40 // 64 - 1, "token map has a negative compressed id -1"),
        (torch.arange(64).float() * 40 / 64, "token map has dtype torch.float32, expected integers"),
    ],
)
def test_a_stored_map_that_does_not_fit_is_refused_naming_its_file(
    tmp_path: Path, cfg, stored, fault
) -> None:
    """A stale map (from weights of another config) or a hand-written one is refused at load, the file and
    the way out named; a float map is not truncated into ids."""
    write_random_checkpoint(cfg, tmp_path, seed=1)
    save_file({"engram.token_map": stored}, str(tmp_path / TOKEN_MAP_FILE))
    with pytest.raises(ConfigError, match=fault) as err:
        load_model(None, weights=tmp_path)
    assert str(err.value).startswith(f"{tmp_path / TOKEN_MAP_FILE}: ")
    assert "the stored Engram map is not this config's" in str(err.value)
