"""Weights save/load under DeepSeek tensor names (safetensors), and the errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvdiet.config import ConfigError, load_config
from kvdiet.model.checkpoint import Checkpoint
from kvdiet.model.export import save_checkpoint, write_random_checkpoint
from kvdiet.model.loader import WeightsError, load_checkpoint, load_weights, save_weights
from kvdiet.model.memory import InsufficientMemoryError, check_fits
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


def test_fp8_block_scaled_linear_keeps_or_dequantises_by_numerics(tmp_path: Path, pair) -> None:
    a, b = pair
    tensors = {k: v.contiguous() for k, v in a.state_dict().items()}
    w = tensors["layers.1.attn.wkv.weight"]  # [64, 64]
    scale = torch.tensor([[0.5, 2.0], [1.0, 4.0]])  # float scales, as the base releases store them
    tiles = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    tensors["layers.1.attn.wkv.weight"] = (w / tiles).to(torch.float8_e4m3fn)
    tensors["layers.1.attn.wkv.scale"] = scale
    save_file(tensors, str(tmp_path / "fp8.safetensors"))
    expected = (w / tiles).to(torch.float8_e4m3fn).float() * tiles
    report = load_weights(b, tmp_path / "fp8.safetensors", numerics="bf16")
    assert report.numerics == "bf16" and report.linears["fp8"] == 0
    assert torch.equal(b.state_dict()["layers.1.attn.wkv.weight"], expected)
    report = load_weights(b, tmp_path / "fp8.safetensors")  # auto: the file holds a quantised linear → fp8
    assert report.numerics == "fp8" and report.linears["fp8"] == 1
    lin = b.layers[1].attn.wkv
    assert lin.storage == "fp8" and torch.equal(lin.dense_weight(), expected)


def test_not_a_safetensors_file(tmp_path: Path, pair) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_text('{"a": 1}')
    with pytest.raises(WeightsError, match="is not a valid safetensors file"):
        load_weights(pair[1], bad)


# --- the released checkpoint layout -----------------------------------------------------------------

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def released(tmp_path_factory, pair) -> Path:
    """v4.1-micro (seed 1) written in the released layout: FP8 linears, FP4 experts, FP8 Engram tables."""
    return save_checkpoint(pair[0], tmp_path_factory.mktemp("released"), shard_bytes=40_000)


def _logits(model: Transformer) -> torch.Tensor:
    return model.prefill(model.new_state(), TOKENS, all_logits=True)


def test_released_layout_is_what_deepseek_ships(released: Path) -> None:
    index = json.loads((released / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    ckpt = Checkpoint.open(released)
    dtypes = {name: info.dtype for name, info in ckpt.tensors.items()}
    assert (
        dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    )
    assert dtypes["layers.1.ffn.experts.0.w1.weight"] == "F4"
    assert ckpt.tensors["layers.1.ffn.experts.0.w1.weight"].shape == (32, 32)  # [out, in/2]
    assert ckpt.tensors["layers.1.ffn.experts.0.w1.scale"].shape == (32, 2)  # [out, in/32]
    assert (
        dtypes["layers.0.engram.embed.weight"] == "F8_E4M3"
        and dtypes["layers.0.engram.embed.scale"] == "F8_E8M0"
    )
    assert dtypes["layers.1.attn.wo_a.weight"] == "BF16" and dtypes["layers.1.attn.attn_sink"] == "F32"
    assert json.loads((released / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_released_checkpoint_runs_fp8_numerics(released: Path, pair) -> None:
    model, report = load_checkpoint(released)
    assert report.numerics == "fp8" and report.lazy_experts
    assert report.linears["fp4"] == 9 * 4 * 3 and report.linears["fp8"] > 0
    eager = Transformer.from_config(load_config("v4.1-micro"), seed=7)
    load_weights(eager, released)  # the same weights, every tensor read up front
    assert torch.equal(_logits(model), _logits(eager))
    bf16, _ = load_checkpoint(released, numerics="bf16")
    fp8, ref = _logits(model), _logits(pair[0])
    assert not torch.equal(fp8, _logits(bf16))  # activation quantisation changes the numbers ...
    assert (fp8 - ref).abs().max() < 0.05 * ref.abs().max()  # ... a little


def test_experts_are_read_on_first_use_within_a_budget(released: Path) -> None:
    unlimited, full = load_checkpoint(released)
    tight, report = load_checkpoint(released, expert_cache_bytes=4_000)  # one expert (3,264 B) fits
    for _ in range(2):
        assert torch.equal(_logits(unlimited), _logits(tight))  # a re-read expert holds the same bytes
    stats = report.expert_cache.stats()  # 9 layers × 4 experts, each used by the 13 tokens, twice
    assert (stats.loads, stats.hits, stats.evictions) == (72, 0, 71)
    assert stats.resident_bytes == stats.peak_bytes == 3_264 and stats.bytes_read == 72 * 3_264
    assert (full.expert_cache.stats().loads, full.expert_cache.stats().hits) == (36, 36)
    assert all(t.device.type == "meta" for t in tight.layers[1].ffn.experts[0].parameters())  # never resident


def test_engram_tables_read_row_by_row_give_the_same_logits(released: Path) -> None:
    resident, _ = load_checkpoint(released)
    rows, report = load_checkpoint(released, table_resident_bytes=0)
    assert report.row_tables == ("layers.0.engram.embed.weight", "layers.3.engram.embed.weight")
    assert rows.layers[0].engram.embed.weight.device.type == "meta"
    assert torch.equal(_logits(resident), _logits(rows))


def test_engram_table_loads_from_bf16_and_fp8_checkpoints(tmp_path: Path, pair) -> None:
    a, _ = pair
    tensors = {k: v.contiguous() for k, v in a.state_dict().items()}
    table = a.layers[0].engram.embed(torch.arange(a.layers[0].engram.embed.rows))  # dequantised rows
    bf16 = dict(tensors)
    bf16["layers.0.engram.embed.weight"] = table.to(torch.bfloat16)  # a bf16 conversion: values, no scale
    del bf16["layers.0.engram.embed.scale"]
    fp8 = dict(tensors)
    fp8["layers.0.engram.embed.weight"] = tensors["layers.0.engram.embed.weight"].view(torch.float8_e4m3fn)
    fp8["layers.0.engram.embed.scale"] = tensors["layers.0.engram.embed.scale"].view(torch.float8_e8m0fnu)
    for name, ts in (("bf16", bf16), ("fp8", fp8)):
        save_file(ts, str(tmp_path / f"{name}.safetensors"))
        b = Transformer.from_config(load_config("v4.1-micro"), seed=5)
        load_weights(b, tmp_path / f"{name}.safetensors")
        rows = torch.arange(a.layers[0].engram.embed.rows)  # the same row values (the bytes may rescale)
        assert torch.equal(b.layers[0].engram.embed(rows), a.layers[0].engram.embed(rows)), name
        assert torch.equal(_logits(a), _logits(b)), name


def test_fp4_experts_stored_as_int8_or_uint8_load_the_same(tmp_path: Path, released: Path) -> None:
    ckpt = Checkpoint.open(released)
    tensors = {name: ckpt.read(name) for name in ckpt.tensors}
    reference, _ = load_checkpoint(released)
    for dtype in (torch.int8, torch.uint8):
        out = tmp_path / str(dtype).split(".")[-1]
        out.mkdir()
        (out / "config.json").write_text((released / "config.json").read_text())
        packed = {k: v.view(dtype) if v.dtype == torch.float4_e2m1fn_x2 else v for k, v in tensors.items()}
        save_file(packed, str(out / "model.safetensors"))
        model, _ = load_checkpoint(out)
        assert torch.equal(_logits(model), _logits(reference)), dtype


def test_hf_style_names_are_mapped_and_drafter_tensors_skipped(tmp_path: Path, released: Path) -> None:
    ckpt = Checkpoint.open(released)
    renamed = {}
    for name in ckpt.tensors:
        hf = "model." + name.replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
        hf = hf.replace("model.embed.", "model.embed_tokens.").replace("model.head.", "lm_head.")
        renamed[hf.replace(".gate.bias", ".gate.e_score_correction_bias")] = ckpt.read(name)
    renamed["mtp.0.embed.weight"] = torch.zeros(2, 2)
    renamed["vision.patch.weight"] = torch.zeros(2)
    (tmp_path / "config.json").write_text((released / "config.json").read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model, report = load_checkpoint(tmp_path)
    assert report.skipped == 2
    reference, _ = load_checkpoint(released)
    assert torch.equal(_logits(model), _logits(reference))


def test_released_format_errors_are_named_before_anything_loads(tmp_path: Path, released: Path) -> None:
    ckpt = Checkpoint.open(released)
    tensors = {name: ckpt.read(name) for name in ckpt.tensors}
    (tmp_path / "config.json").write_text((released / "config.json").read_text())
    bad = dict(tensors)
    bad["layers.2.ffn.experts.1.w2.weight"] = tensors["layers.2.ffn.experts.1.w2.weight"][:, :8].contiguous()
    del bad["layers.3.attn.wq_a.scale"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError) as err:
        load_checkpoint(tmp_path)
    text = str(err.value)
    assert "(2 problems)" in text
    assert "tensor layers.2.ffn.experts.1.w2.weight (F4 (64, 8))" in text and "fp4 stores (64, 16)" in text
    assert "tensor layers.3.attn.wq_a.weight is F8_E4M3 but layers.3.attn.wq_a.scale is missing" in text


def test_truncated_shard_and_bad_index_are_named(tmp_path: Path, released: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(released, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=f"{shard.name}: tensor .* needs"):
        Checkpoint.open(copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["x"] = "model-99999-of-99999.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="names shards that are not there: model-99999"):
        Checkpoint.open(copy)


def test_read_rows_equals_rows_of_the_whole_tensor(released: Path) -> None:
    ckpt = Checkpoint.open(released)
    rows = torch.tensor([3, 0, 3, 17])
    for name in ("layers.0.engram.embed.weight", "layers.0.engram.embed.scale", "embed.weight"):
        whole = ckpt.read(name)
        assert torch.equal(ckpt.read_rows(name, rows).view(torch.uint8), whole[rows].view(torch.uint8)), name


def test_memory_check_comes_before_any_allocation() -> None:
    cfg = load_config("deepseek-v4.1-flash")
    with pytest.raises(
        InsufficientMemoryError, match=r"deepseek-v4.1-flash with random weights needs ~3,9\d\d\.\d GB"
    ):
        Transformer.from_config(cfg)
    with pytest.raises(InsufficientMemoryError, match=r"this machine has 0\.0 GB available"):
        check_fits("x", 10, have=1)
    check_fits("x", 10, have=10)


def test_building_on_meta_imports_no_compiler_stack() -> None:
    # A meta-device build initialises nothing: a meta ``normal_`` goes through torch's refs and imports
    # torch._dynamo (~100 MB resident), which pushed a budgeted `generate` over its memory budget.
    code = (
        "import sys; from kvdiet.config import load_config; from kvdiet.model.transformer import Transformer; "
        "m = Transformer(load_config('v4.1-micro'), meta=True); "
        "assert m.embed.weight.is_meta; print('torch._dynamo' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.strip() == "False"


def test_random_checkpoint_refuses_experts_too_narrow_for_fp4(tmp_path: Path) -> None:
    cfg = load_config("v4.1-micro")
    for field, value in (("hidden_size", 80), ("moe_intermediate_size", 48)):
        with pytest.raises(ValueError, match=f"{field} {value} is not a multiple of 32"):
            write_random_checkpoint(cfg.replace(**{field: value}), tmp_path / field)
        assert not (tmp_path / field).exists()  # nothing written


def test_fp8_numerics_refuse_a_quantised_linear_of_partial_activation_blocks(tmp_path: Path) -> None:
    # wq_b takes q_lora_rank inputs; FP8 activations come in blocks of 32. Refused at load (fp8 numerics from the
    # quantization_config), not in the middle of the first forward.
    cfg = load_config("v4.1-micro").replace(q_lora_rank=48)
    write_random_checkpoint(cfg, tmp_path, seed=0)
    with pytest.raises(
        ConfigError, match=r"layers\.0\.attn\.wq_b\.weight takes 48 inputs, not a multiple of 32"
    ) as info:
        load_checkpoint(tmp_path)
    assert str(info.value).endswith("load with numerics='bf16' or use whole blocks")  # Python's spelling
    assert info.value.as_flags().endswith("load with --numerics bf16 or use whole blocks")  # the CLI's
    with pytest.raises(ConfigError, match="takes 48 inputs"):
        load_weights(Transformer.from_config(cfg, seed=0), tmp_path)
    model, report = load_checkpoint(tmp_path, numerics="bf16")  # dequantised weights take any width
    logits = model.prefill(model.new_state(), [3, 4, 5])
    assert report.numerics == "bf16" and logits.shape == (64,) and bool(torch.isfinite(logits).all())


def test_random_checkpoint_of_any_head_dim_runs_with_the_caches_that_take_it(tmp_path: Path) -> None:
    """A checkpoint does not depend on the cache format: head_dim 48 is written, then runs with exact (fp32)
    caches and is refused only by the packed ones (whole 32-value scale blocks), when they are built."""
    cfg = load_config("v4.1-micro").replace(head_dim=48)
    write_random_checkpoint(cfg, tmp_path, seed=0)
    model, _ = load_checkpoint(tmp_path, exact=True, numerics="bf16")
    logits = model.prefill(model.new_state(), [3, 4, 5])
    assert logits.shape == (64,) and bool(torch.isfinite(logits).all())
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of 32"):
        load_checkpoint(tmp_path)


def test_random_checkpoint_files_follow_the_umask(tmp_path: Path) -> None:
    """Every file the writer creates gets 0666 less the umask, as ``open`` gives (safetensors writes a
    0600 temporary file and renames it)."""
    cfg = load_config("v4.1-micro").replace(engram_compressed_vocab_size=40)  # also writes the token map
    old = os.umask(0o027)
    try:
        write_random_checkpoint(cfg, tmp_path, seed=0, shard_bytes=200_000)
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert len(modes) > 4 and "engram_token_map.safetensors" in modes  # several shards, index, config, map
    assert set(modes.values()) == {0o640}, modes
