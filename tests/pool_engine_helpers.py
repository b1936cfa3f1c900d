"""What the engine tests on a shared SWA pool (Redis, Mooncake) have in common (not a test module): the
v4.1-micro runner on a pool URL, one request with one decode step, and the comparisons of their logits."""

from __future__ import annotations

import torch

from kvdiet.cache.policies import parse_policy
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
