"""A checkpoint several times larger than a memory budget runs within it: routed experts are read on first use
and the process's peak resident memory stays under the budget (measured in a separate process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiet.config import load_config
from kvdiet.model.export import write_random_checkpoint

BUDGET = 640_000_000  # bytes of peak RSS for the whole `kvdiet generate` process (torch alone is ~300 MB)


@pytest.mark.slow
def test_generate_runs_a_checkpoint_larger_than_its_memory_budget(tmp_path: Path) -> None:
    # v4.1-micro's 9 layers with 384 experts of 256 × 1,536: 2.2 GB, nearly all FP4 routed experts
    cfg = load_config("v4.1-micro").replace(hidden_size=256, moe_intermediate_size=1536, n_routed_experts=384)
    write_random_checkpoint(cfg, tmp_path, seed=0, shard_bytes=256 << 20)
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert on_disk > 3 * BUDGET
    cmd = [
        sys.executable, "-m", "kvdiet.cli", "generate", "--weights", str(tmp_path),
        "--prompt-ids", ",".join(str(3 + i % 60) for i in range(24)), "--max-tokens", "3",
        "--expert-cache-size", "32MB", "--kv-cache-memory", "16MB", "--persistent-dir", "none", "--json",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["numerics"] == "fp8" and out["output_tokens"] == 3
    assert out["checkpoint_bytes"] > 3 * BUDGET
    assert out["peak_rss_bytes"] < BUDGET, out["peak_rss_bytes"]
    cache = out["expert_cache"]
    assert cache["peak_bytes"] <= 32_000_000 and cache["evictions"] > 0
    assert cache["bytes_read"] < on_disk  # only the experts the tokens chose were read


def test_a_model_that_cannot_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvdiet.cli", "generate", "--model", "deepseek-v4.1-flash", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert "deepseek-v4.1-flash with random weights needs ~3,9" in lines[0] and "this machine has" in lines[0]
