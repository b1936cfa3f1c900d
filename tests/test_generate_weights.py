"""`kvdiet generate --weights DIR`: a checkpoint folder in the released layout, run from the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiet.config import load_config
from kvdiet.model.export import save_checkpoint
from kvdiet.model.transformer import Transformer


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    model = Transformer.from_config(load_config("v4.1-micro"), seed=3)
    return save_checkpoint(model, tmp_path_factory.mktemp("micro"))


def _generate(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvdiet.cli", "generate", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "3"]
    return subprocess.run(
        [*cmd, "--persistent-dir", "none", *flags], capture_output=True, text=True, timeout=300
    )


def test_generate_reads_the_config_beside_the_weights(released: Path) -> None:
    run = _generate("--weights", str(released), "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["model"] == str(released / "config.json") and out["weights"] == str(released)
    assert out["numerics"] == "fp8" and out["output_tokens"] == 3
    assert out["expert_cache"]["loads"] > 0 and out["checkpoint_bytes"] > 0 and out["peak_rss_bytes"] > 0
    bf16 = json.loads(_generate("--weights", str(released), "--numerics", "bf16", "--json").stdout)
    assert bf16["numerics"] == "bf16"


def test_weights_flags_are_checked_before_loading(released: Path, tmp_path: Path) -> None:
    run = _generate("--expert-cache-size", "1GB")
    assert run.returncode == 2 and "--expert-cache-size goes with --weights" in run.stderr
    run = _generate("--weights", str(released), "--expert-cache-size", "lots")
    assert run.returncode == 2 and run.stderr.startswith("kvdiet generate: error: --expert-cache-size:")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    run = _generate("--weights", str(tmp_path))
    assert run.returncode == 2 and "has no config.json beside it; give --model" in run.stderr
    run = _generate("--weights", str(released), "--model", "v4.1-mini")  # a config the weights do not fit
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (
        "--model 'v4.1-mini' has vocab_size 129280 but the checkpoint's" in run.stderr
    )  # the config.json beside
    assert run.stderr.rstrip().endswith("has 64: leave --model out to run the checkpoint's own config")


def test_the_server_start_up_log_says_which_numerics_run(released: Path) -> None:
    from kvdiet.model.build import load_model
    from kvdiet.server.serve import weights_line

    random_model, _ = load_model("v4.1-micro")
    assert weights_line(random_model) == "weights: seeded random (bf16 numerics: plain fp32 matmuls)"
    model, _ = load_model(None, weights=released, expert_cache_bytes=10_000)
    line = weights_line(model)
    assert "fp8 numerics (FP8 activations before every FP8/FP4 linear" in line
    assert "linears 22 dense, 69 fp8, 108 fp4" in line and line.endswith("cache 10.00 KB")  # not "0.00 GB"
    size = sum(f.stat().st_size for f in released.glob("*.safetensors"))  # and headers (5% of it here)
    shown = re.match(r"weights: (\d+\.\d\d) MB checkpoint; ", line)
    assert shown and 0.9 * size < float(shown[1]) * 1e6 <= size, (line, size)
    model, _ = load_model(None, weights=released, numerics="bf16")
    assert "bf16 numerics (weights dequantised, plain fp32 matmuls)" in weights_line(model)
