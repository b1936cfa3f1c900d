"""``--swa-pool`` specs → SWA-pool backends: parses a spec (``in-process``, Redis URLs or a Mooncake URL) and builds
the backend it names. The only module that knows every backend; the backends do not know each other.
"""

from __future__ import annotations

from kvdiet.storage.clock import Clock
from kvdiet.storage.mooncake_pool import MooncakeSwaPool
from kvdiet.storage.mooncake_urls import check_mooncake_spec, is_mooncake_url
from kvdiet.storage.redis_pool import RedisSwaPool
from kvdiet.storage.redis_urls import parse_redis_urls
from kvdiet.storage.swa_pool import DEFAULT_SWA_POOL_TTL_S, IN_PROCESS, InProcessSwaPool, SwaPool

__all__ = ["check_swa_pool_spec", "create_swa_pool"]


def check_swa_pool_spec(spec: str) -> str:
    """``spec`` if it names a backend: ``in-process``, Redis URLs (`kvdiet.storage.redis_urls.parse_redis_urls`) or a
    Mooncake URL (`kvdiet.storage.mooncake_urls.parse_mooncake_url`).

    Raises:
        ValueError: anything else, naming the accepted forms; a Mooncake URL without the ``mooncake`` package
            installed (the ``kvdiet[mooncake]`` extra).
    """
    if spec.strip() == IN_PROCESS:
        return IN_PROCESS
    if is_mooncake_url(spec):
        return check_mooncake_spec(spec, flag="--swa-pool")
    parse_redis_urls(spec)
    return spec.strip()


def create_swa_pool(
    spec: str,
    *,
    namespace: str,
    capacity_bytes: int | None = None,
    ttl_s: float = DEFAULT_SWA_POOL_TTL_S,
    clock: Clock | None = None,
) -> SwaPool:
    """The backend ``spec`` names (see `check_swa_pool_spec`), not opened yet.

    ``namespace`` (the model fingerprint in hex) separates models on a shared backend; ``capacity_bytes``
    bounds the in-process pool and sizes the segment this process gives a Mooncake pool (0: none; a Redis
    server's budget is its ``maxmemory``); ``ttl_s`` in seconds; ``clock`` drives the in-process and Mooncake
    TTLs (Redis expires keys on the server's clock).
    Raises:
        ValueError: a bad spec, capacity or TTL.
    """
    if check_swa_pool_spec(spec) == IN_PROCESS:
        return InProcessSwaPool(capacity_bytes, ttl_s=ttl_s, clock=clock)
    if is_mooncake_url(spec):
        return MooncakeSwaPool(
            spec, namespace=namespace, ttl_s=ttl_s, segment_bytes=capacity_bytes, clock=clock
        )
    return RedisSwaPool(spec, namespace=namespace, ttl_s=ttl_s)
