"""Prometheus metrics of a serving engine (``GET /metrics``), named like vLLM's with a ``kvdiet:`` prefix.

Two sources, one private registry per server (no global state):
- `ServerMetrics` is the engine's `EngineObserver`: latency histograms (time to first token, inter-token
  latency, end-to-end) and finished-request counts, observed on the engine thread as tokens come out;
- `_SnapshotCollector` turns the loop's latest `EngineSnapshot` into gauges and counters at scrape time:
  device-pool usage, running/waiting requests, prefix-cache queries and hits in tokens by tier, replayed
  and computed prompt tokens, bytes and entries resident in the persistent tier and the SWA pool, and per
  tier the evictions, expirations, corrupt entries dropped, bytes written/read, write errors and (the SWA
  pool on Redis) failed backend calls.

``kvdiet:kv_cache_usage_perc`` is a fraction in [0, 1] (1 = every device block referenced), as vLLM's
``vllm:kv_cache_usage_perc`` is. Token counters count prompt tokens per lookup (`TierCounters`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvdiet.cache.counters import TierCounters
from kvdiet.engine.engine_snapshot import EngineSnapshot
from kvdiet.engine.request import Request

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40)
_TIERS = (
    "device",
    "persistent",
    "swa_pool",
    "global_pool",
)  # ``tier`` label values; [2:] are remote backends


class ServerMetrics:
    """The registry behind ``/metrics`` and the engine observer that feeds its histograms.

    Args:
        snapshot: returns the engine loop's latest `EngineSnapshot` (`EngineLoop.snapshot`; None before the
            loop starts: then only the histograms and counters are exported).
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str) -> None:
        self.registry, self.model_name = CollectorRegistry(), model_name
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(
            "kvdiet:time_to_first_token_seconds",
            "Time from arrival to the first output token (s).",
            buckets=_TTFT_BUCKETS,
            **labels,
        ).labels(model_name)
        self.itl = Histogram(
            "kvdiet:inter_token_latency_seconds",
            "Time between two output tokens of a request (s).",
            buckets=_ITL_BUCKETS,
            **labels,
        ).labels(model_name)
        self.e2e = Histogram(
            "kvdiet:e2e_request_latency_seconds",
            "Time from arrival to the last output token (s).",
            buckets=_TTFT_BUCKETS,
            **labels,
        ).labels(model_name)
        self.success = Counter(
            "kvdiet:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(snapshot, model_name))

    # EngineObserver
    def on_first_token(self, request: Request, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token(self, request: Request, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def on_finish(self, request: Request) -> None:
        self.success.labels(self.model_name, request.finish_reason.value).inc()
        end = request.last_token_time if request.last_token_time is not None else time.monotonic()
        self.e2e.observe(end - request.arrival_time)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Prometheus collector over the latest `EngineSnapshot` (read once per scrape)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:
            return
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kvdiet:{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvdiet:{name}", doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        tiers = dict(zip(_TIERS, (s.device, s.persistent, s.swa_pool, s.global_pool), strict=True))

        def by_tier(
            name: str, doc: str, value: Callable[[TierCounters], int], labels: tuple[str, ...] = _TIERS
        ) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvdiet:{name}", doc, labels=["model_name", "tier"])
            for tier in labels:
                c.add_metric([*m, tier], value(tiers[tier]))
            return c

        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of device KV blocks referenced by requests (0-1).",
            s.kv_cache_usage,
        )
        yield gauge("num_requests_running", "Requests holding device blocks.", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued (new or preempted).", s.num_waiting)
        yield gauge(
            "kv_cache_free_blocks",
            "Device blocks free (including cached, unreferenced).",
            s.num_free_blocks,
        )
        yield gauge(
            "kv_cache_cached_blocks",
            "Device blocks unreferenced but findable by hash.",
            s.num_cached_blocks,
        )
        yield counter(
            "num_preemptions", "Requests preempted (blocks returned, re-queued).", s.num_preemptions
        )
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Output tokens generated.", s.generation_tokens)
        yield by_tier(
            "prefix_cache_queries", "Prompt tokens looked up, by tier (tokens).", lambda t: t.query_tokens
        )
        yield by_tier("prefix_cache_hits", "Prompt tokens found, by tier (tokens).", lambda t: t.hit_tokens)
        yield by_tier("cache_evictions", "Entries evicted for capacity, by tier.", lambda t: t.evictions)
        yield by_tier(
            "cache_expirations", "Entries dropped at their TTL, by tier.", lambda t: t.expirations, _TIERS[1:]
        )
        yield by_tier(
            "cache_corrupt_dropped",
            "Entries failing validation (a miss), by tier.",
            lambda t: t.corrupt_dropped,
            _TIERS[1:],
        )
        yield by_tier(
            "cache_read_errors",
            "Entry reads that failed on that entry alone (unreadable file; a miss), by tier.",
            lambda t: t.read_errors,
            _TIERS[1:],
        )
        yield by_tier(
            "cache_bytes_written", "Bytes written to a tier.", lambda t: t.bytes_written, _TIERS[1:]
        )
        yield by_tier("cache_bytes_read", "Bytes read back from a tier.", lambda t: t.bytes_read, _TIERS[1:])
        yield by_tier(
            "cache_write_errors",
            "Writes to a tier that failed (disk full, backend down).",
            lambda t: t.write_errors,
            _TIERS[1:],
        )
        yield by_tier(
            "cache_backend_errors",
            "Calls to a remote tier backend that failed (connection refused or lost, timeout, error reply).",
            lambda t: t.backend_errors,
            _TIERS[2:],
        )
        yield counter(
            "replayed_tokens",
            "Tokens recomputed below a prefix hit to rebuild window state.",
            s.replayed_tokens,
        )
        yield counter(
            "prompt_computed_tokens",
            "Prompt tokens prefilled (not served by a cache tier).",
            s.computed_tokens,
        )
        yield counter(
            "swa_snapshot_restores",
            "Window states restored from a snapshot.",
            s.snapshot_restores,
        )
        yield counter("swa_snapshots_stored", "Window snapshots stored.", s.snapshots_stored)
        yield gauge("persistent_bytes", "Bytes resident in the persistent tier.", s.persistent_bytes)
        yield gauge("persistent_entries", "Entries resident in the persistent tier.", s.persistent_entries)
        yield gauge("swa_pool_bytes", "Bytes resident in the SWA pool.", s.swa_pool_bytes)
        yield gauge("swa_pool_entries", "Snapshots resident in the SWA pool.", s.swa_pool_entries)
