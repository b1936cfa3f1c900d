"""One Redis server (or a whole Redis Cluster) as the Redis SWA pool sees it: its URL and rendezvous identity,
the client made with the pool's timeouts, the registered drop script, its health and its memory statistics.

`RedisServer.connect` and `RedisServer.query_stats` do the I/O and raise what redis-py raises; when a server
is backed off, what is logged and what is counted are the pool's decisions (`kvdiet.storage.redis_pool`).
Not known here: keys, values, manifests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvdiet.storage.redis_urls import redact_url

__all__ = ["DROP_SCRIPT", "RedisServer"]

DROP_SCRIPT = """
for i = 2, #KEYS do redis.call('UNLINK', KEYS[i]) end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('UNLINK', KEYS[1]) return 1 end
return 0
"""
"""Deletes KEYS[2..] (chunks of the manifest read) and KEYS[1] (the manifest) if it still holds ARGV[1];
returns 1 if it did (the entry really was incomplete or corrupt), 0 if a writer replaced it meanwhile."""


@dataclass(slots=True)
class RedisServer:
    """One Redis server (or a whole cluster) and its health, as this process sees it."""

    url: str
    ident: bytes  # what keys are hashed against (rendezvous)
    client: Any = None  # redis.Redis | RedisCluster, made by `connect`
    drop: Any = None  # the registered `DROP_SCRIPT`
    down_until: float = 0.0  # time.monotonic() before which calls skip this server
    down: bool = False  # the last call failed (for the reconnect log line)
    warned_at: float = -math.inf
    stats: tuple[int, int] = (0, 0)  # used_memory (B), keys
    stats_at: float = -math.inf

    @property
    def cluster(self) -> bool:
        return "+cluster" in urlsplit(self.url).scheme

    @property
    def name(self) -> str:
        """The URL without its password (`redact_url`)."""
        return redact_url(self.url)

    def connect(self, *, connect_timeout_s: float, socket_timeout_s: float) -> Any:
        """Make the client (a cluster client asks a node for the slot map now) and register the drop script;
        returns the client, also kept in ``client``. Timeouts in seconds.

        Raises:
            RedisError, RedisClusterException, OSError: nothing is kept then.
        """
        options = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            # One immediate retry: a pooled connection to a restarted server reconnects in the same call.
            "retry": Retry(NoBackoff(), 1),
        }
        if self.cluster:
            client = RedisCluster.from_url(self.url.replace("+cluster://", "://", 1), **options)
        else:
            client = redis.Redis.from_url(self.url, **options)
        self.drop = client.register_script(DROP_SCRIPT)
        self.client = client
        return client

    def query_stats(self, client: Any) -> tuple[int, int]:
        """(``used_memory`` in bytes, keys) of the server, or of every primary of a cluster, summed.

        Raises:
            RedisError, RedisClusterException, OSError.
        """
        every = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        info, keys = client.info("memory", **every), client.dbsize(**every)
        if "used_memory" in info:
            used = int(info["used_memory"])
        else:  # a cluster answers per primary
            used = sum(int(v.get("used_memory", 0)) for v in info.values() if isinstance(v, dict))
        return used, int(keys)
