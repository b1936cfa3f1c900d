"""What the engine tests on a shared SWA pool (Redis, Mooncake) have in common (not a test module): the
v4.1-micro runner on a pool URL, one request with one decode step, the comparisons of their logits, and
``kvdiet generate`` in a process of its own or in this one."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from kvdiet.cache.policies import parse_policy
from kvdiet.cli import main
from kvdiet.engine.runner import CacheOptions, ModelRunner, Session
from kvdiet.model.transformer import Transformer

W, BS = 8, 4
REPLAY_BOUND = 1e-3  # as in test_engine_runner: a bounded replay moves micro's logits by ~5e-5


def ids(n: int, seed: int = 1) -> list[int]:
    """``n`` seeded token ids of v4.1-micro's 64-token vocabulary."""
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_cache(model: Transformer, swa_pool: str, segment_bytes: int | None = None) -> ModelRunner:
    """A bounded-replay runner (blocks of 4 tokens, 200 device blocks) whose SWA pool is ``swa_pool``."""
    opts = CacheOptions(
        kv_cache_memory=200 * model.new_pool(1, block_size=BS).block_bytes,
        block_size=BS,
        swa_pool=swa_pool,
        swa_pool_size=segment_bytes,
        policy=parse_policy("bounded-replay"),
        decoder_replay=False,
    )
    return ModelRunner(model, opts)


def run_one(cache: ModelRunner, prompt: list[int]) -> tuple[Session, list[torch.Tensor]]:
    """Prefill ``prompt`` in chunks of 16 and decode one token; the session and both logits rows."""
    s = cache.start(prompt)
    out = [cache.prefill(s, chunk_size=16), cache.decode([s], [5])[0]]
    cache.finish(s)
    return s, out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(float((x - y).abs().max()) < REPLAY_BOUND for x, y in zip(a, b, strict=True))


KVDIET = [sys.executable, "-m", "kvdiet.cli"]
GENERATE = ["generate", "--model", "v4.1-micro", "--max-tokens", "3", "--block-size", "4"]


def generate_process(argv: list[str]) -> dict:
    """``kvdiet generate`` on v4.1-micro (3 tokens, blocks of 4) with ``argv`` in a process of its own; its
    ``--json`` output."""
    proc = subprocess.run([*KVDIET, *GENERATE, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def generate_here(argv: list[str], capsys) -> dict:
    """The same ``kvdiet generate`` in this process (``capsys``: pytest's capture fixture)."""
    assert main([*GENERATE, *argv]) == 0
    return json.loads(capsys.readouterr().out)
