"""Weights save/load under DeepSeek tensor names (safetensors), and the errors for checkpoints that do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvdiet.config import load_config
from kvdiet.model.loader import WeightsError, load_weights, save_weights
from kvdiet.model.transformer import Transformer


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer]:
    cfg = load_config("v4.1-micro")
    return Transformer.from_config(cfg, seed=1), Transformer.from_config(cfg, seed=2)


def test_reference_names() -> None:
    names = set(Transformer.from_config(load_config("v4.1-micro"), seed=0).state_dict())
    for name in (
        "embed.weight", "head.weight", "norm.weight", "layers.1.hc_attn_fn", "layers.1.hc_ffn_base",
        "layers.1.attn.wq_a.weight", "layers.1.attn.q_norm.weight", "layers.1.attn.wkv.weight",
        "layers.1.attn.attn_sink", "layers.1.attn.compressor.wgate.weight", "layers.1.attn.compressor.norm.weight",
        "layers.1.attn.indexer.wk.weight", "layers.1.attn.indexer.k_norm.weight",
        "layers.7.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.bias", "layers.1.ffn.experts.3.w2.weight",
        "layers.1.ffn.shared_experts.w1.weight", "layers.0.engram.embed.weight", "layers.0.engram.embed.scale",
        "layers.0.engram.q_weight",
    ):  # fmt: skip
        assert name in names, name
    assert "layers.5.attn.compressor.wgate.weight" not in names  # ratio 1: no gate
    assert "layers.7.attn.indexer.wk.weight" not in names  # Reindex: no keys of its own
    assert not any(
        n.startswith("layers.2.attn.compressor") or n.startswith("layers.2.attn.indexer") for n in names
    )
    assert not any(n.startswith("model.") for n in names)


def test_round_trip(tmp_path: Path, pair) -> None:
    a, b = pair
    path = save_weights(a, tmp_path / "w.safetensors")
    load_weights(b, path)
    toks = [5, 6, 7, 8, 9, 10]
    assert torch.equal(a.prefill(a.new_state(), toks), b.prefill(b.new_state(), toks))


def test_errors_name_the_tensor(tmp_path: Path, pair) -> None:
    a, b = pair
    tensors = load_file(str(save_weights(a, tmp_path / "w.safetensors")))
    before = b.state_dict()["head.weight"].clone()
    missing = dict(tensors)
    del missing["layers.3.attn.compressor.wkv.weight"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(WeightsError, match=r"missing tensor layers\.3\.attn\.compressor\.wkv\.weight"):
        load_weights(b, tmp_path / "missing.safetensors")
    wrong = dict(tensors)
    wrong["head.weight"] = torch.zeros(3, 3)
    wrong["layers.0.bogus"] = torch.zeros(1)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(WeightsError) as err:
        load_weights(b, tmp_path / "wrong.safetensors")
    assert "tensor head.weight has shape (3, 3), the model expects (64, 64)" in str(err.value)
    assert "unexpected tensor layers.0.bogus" in str(err.value)
    assert torch.equal(b.state_dict()["head.weight"], before)  # nothing loaded
    with pytest.raises(FileNotFoundError):
        load_weights(b, tmp_path / "nowhere")


def test_fp8_block_scaled_linear_is_dequantised(tmp_path: Path, pair) -> None:
    a, b = pair
    tensors = {k: v.contiguous() for k, v in a.state_dict().items()}
    w = tensors["layers.1.attn.wkv.weight"]  # [64, 64]
    scale = torch.tensor([[0.5, 2.0], [1.0, 4.0]])
    tiles = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    tensors["layers.1.attn.wkv.weight"] = (w / tiles).to(torch.float8_e4m3fn)
    tensors["layers.1.attn.wkv.scale"] = scale
    save_file(tensors, str(tmp_path / "fp8.safetensors"))
    load_weights(b, tmp_path / "fp8.safetensors")
    expected = (w / tiles).to(torch.float8_e4m3fn).float() * tiles
    assert torch.equal(b.state_dict()["layers.1.attn.wkv.weight"], expected)


def test_not_a_safetensors_file(tmp_path: Path, pair) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_text('{"a": 1}')
    with pytest.raises(WeightsError, match="is not a valid safetensors file"):
        load_weights(pair[1], bad)
