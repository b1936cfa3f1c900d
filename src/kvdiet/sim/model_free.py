"""Model-free trace replay: the cache tiers of a serving instance simulated in trace time, no model run.

Each request of a `Trace` goes through the same steps as `kvdiet.engine.kv_cache.KVCache.start` and the
write path after it, with byte sizes from `kvdiet.cache.spec.CacheSpec` instead of tensors:

1. **Lookup.** The prompt's ``hash_ids`` blocks (chained: an id names a whole prefix) are matched in the
   device pool, then the persistent tier, up to ``(n − 1) // B`` blocks (the last token is always
   computed). H = matched blocks × B.
2. **Restore plan.** `SwaPolicy.plan` of the policy and "is window state stored at
   H?" answered by the SWA pool (``bounded-replay``), the persistent tier's snapshots (``boundary-snapshot``,
   ``checkpoint:K``) or its window blocks (``full-store``). The plan fixes the adopted hit, the window
   source and the replayed tokens.
3. **Writes.** The prompt's and output's full blocks go to the device pool (LRU) and through to the
   persistent tier (an unexpired entry is not rewritten; its TTL is not extended); ``full-store`` also
   writes each block's window entries. Window snapshots, as the engine captures them: at the prompt
   boundary ``(n − 1) // B × B`` when prefill reaches it, and at the last boundary the output reaches
   (stored when the request finishes) — only positions a forward reaches: past the adopted hit, or at it
   when an exact recompute rebuilt it (a restored state is already stored; a bounded replay's is
   approximate and never stored); ``checkpoint:K`` at every multiple of K instead.

Trace time: a request's lookup happens at its arrival; prefill ends ``prefill GPU-seconds`` later (the
`kvdiet.sim.cost` model) and the request finishes ``output_tokens / output_tok_s`` after that. Snapshots
and blocks are stored at those times; TTLs count from them.

Modelled as the real tiers behave (the tests hold them to `InProcessSwaPool`, `PersistentStore` and
`BlockPool`): fixed TTLs counted from the write, ``now >= deadline`` expired; LRU by last use beyond a byte
budget; a value larger than the whole budget refused. Not modelled: the blocks a running request pins in
the device pool (requests hold nothing between events), persistent-entry header bytes (payload only),
and any reuse of output blocks — the trace's ids cover prompts only, so an output block is never hit.
A trace without ids (Azure) gives every prompt unique blocks.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from kvdiet.cache.manager import KeyKind, RestorePlan, WindowSource
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import ModelConfig
from kvdiet.layer_plan import LayerPlan
from kvdiet.sim.cost import CostModel
from kvdiet.sim.records import RequestResult, SimConfig, SimResult
from kvdiet.sim.traces import Trace
from kvdiet.sim.ttl_lru import TtlLru

__all__ = ["simulate"]


class _Geometry:
    """Byte sizes (from the cache spec) and replay parameters of one config at one block size."""

    def __init__(self, cfg: ModelConfig, block_size: int) -> None:
        spec = CacheSpec.from_config(cfg)
        plan = LayerPlan.from_config(cfg)
        self.block_size = block_size
        self.block_bytes = spec.global_bytes(block_size)
        self.snapshot_bytes = spec.window_bytes_per_request
        self.window_block_bytes = block_size * spec.window_entry_bytes_per_token
        self.window = cfg.sliding_window
        self.num_layers = len(plan.layers)
        self.align = math.lcm(*(plan[s].compress_ratio for s in plan.kv_sources))


def simulate(trace: Trace, config: SimConfig, *, progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay ``trace`` through the tiers of ``config`` (see the module docstring).

    Args:
        trace: requests in arrival order.
        config: sizes, TTLs, policy, cost model.
        progress: called with the number of requests done, every 1,000 and at the end.
    Raises:
        ValueError: from `SimConfig.check`.
    """
    cfg = config.check(trace.block_size)
    return _Run(trace, config, cfg, progress).run()


class _Run:
    def __init__(self, trace: Trace, sc: SimConfig, cfg: ModelConfig, progress) -> None:
        self.trace, self.sc, self.progress = trace, sc, progress
        self.geo = g = _Geometry(cfg, trace.block_size)
        self.cost = CostModel(cfg, sc.gpu, sc.mfu)
        self.device = TtlLru(sc.device_bytes // g.block_bytes * g.block_bytes, None, refresh=False)
        self.persistent = TtlLru(sc.persistent_bytes, sc.persistent_ttl_s, refresh=False)
        self.swa = TtlLru(sc.swa_pool_bytes, sc.swa_pool_ttl_s, refresh=True)
        self.snap_time: dict[object, float] = {}  # snapshot key → when stored (ages of pool hits)
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.unique = itertools.count(-1, -1)  # ids of blocks the trace never names (outputs, Azure)
        self.totals = dict.fromkeys(
            (
                "prompt_tokens",
                "lookup_tokens",
                "device_hit_tokens",
                "persistent_hit_tokens",
                "replayed_tokens",
                "computed_tokens",
                "snapshots_stored",
                "persistent_bytes_written",
                "swa_pool_bytes_written",
            ),
            0,
        )
        self.sources = dict.fromkeys(WindowSource, 0)
        self.flops = 0.0
        self.boundaries: set[int] = set()  # prefix ids at which an earlier request's prompt or output ended
        self.boundary_hits = 0  # requests whose hit H ends at such a boundary (where a snapshot can be)
        self.hits = 0  # requests with any global-KV hit
        self.ages: list[float] = []
        self.results: list[RequestResult] = []

    # --- driver ---

    def run(self) -> SimResult:
        reqs = self.trace.requests
        t0 = reqs[0].arrival_s if reqs else 0.0
        t_end = max((r.arrival_s for r in reqs), default=0.0)
        n = self.sc.samples
        marks = [t0 + (t_end - t0) * i / (n - 1) for i in range(n)]
        series: dict[str, list[float]] = {
            k: [] for k in ("t_s", "device_hit", "persistent_hit", "persistent_bytes", "swa_pool_bytes")
        }
        window = [0, 0, 0]  # prompt, device-hit, persistent-hit tokens since the last sample
        mark = 0
        for i, req in enumerate(reqs):
            while mark < n - 1 and marks[mark] < req.arrival_s:
                self._sample(marks[mark], series, window)
                mark += 1
            self._advance(req.arrival_s)
            before = (self.totals["device_hit_tokens"], self.totals["persistent_hit_tokens"])
            self._request(req)
            window[0] += req.input_tokens
            window[1] += self.totals["device_hit_tokens"] - before[0]
            window[2] += self.totals["persistent_hit_tokens"] - before[1]
            if self.progress is not None and (i + 1) % 1000 == 0:
                self.progress(i + 1)
        while mark < n:
            self._sample(marks[mark], series, window)
            mark += 1
        self._advance(math.inf)  # finish everything still running (their stores count)
        if self.progress is not None:
            self.progress(len(reqs))
        return SimResult(self.sc, self._summary(), series, self.results, self.ages)

    def _sample(self, t: float, series: dict[str, list[float]], window: list[int]) -> None:
        self._advance(t)
        self.persistent.expire(t)
        self.swa.expire(t)
        prompt = window[0]
        series["t_s"].append(round(t, 3))
        series["device_hit"].append(round(window[1] / prompt, 6) if prompt else 0.0)
        series["persistent_hit"].append(round(window[2] / prompt, 6) if prompt else 0.0)
        series["persistent_bytes"].append(self.persistent.nbytes)
        series["swa_pool_bytes"].append(self.swa.nbytes)
        window[:] = [0, 0, 0]

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def _advance(self, now: float) -> None:
        while self.events and self.events[0][0] <= now:
            t, _, fn = heapq.heappop(self.events)
            fn(t)

    # --- one request ---

    def _request(self, req) -> None:
        g, sc, pol = self.geo, self.sc, self.sc.policy
        bs, n, now = g.block_size, req.input_tokens, req.arrival_s
        full = n // bs
        ids = list(req.hash_ids[:full]) if req.hash_ids is not None else []
        ids += [next(self.unique) for _ in range(full - len(ids))]
        usable = (n - 1) // bs if sc.prefix_caching else 0
        d = 0
        while d < usable and self.device.get(ids[d], now):
            d += 1
        p = 0
        while d + p < usable and self.persistent.get((KeyKind.BLOCK, ids[d + p]), now):
            p += 1
        hit = (d + p) * bs
        self.totals["lookup_tokens"] += usable * bs
        self.hits += hit > 0

        found: dict[int, float] = {}

        def has_snapshot(pos: int) -> bool:
            key = (KeyKind.snapshot_in(pol.store), ids[pos // bs - 1])
            if pol.store is WindowSource.SWA_POOL:
                ok = self.swa.get(key, now)
            elif pol.store is WindowSource.WINDOW_BLOCKS:
                first = max(0, pos - g.window) // bs
                ok = all(
                    self.persistent.get((KeyKind.WINDOW_BLOCK, ids[i]), now) for i in range(first, pos // bs)
                )
            else:
                ok = self.persistent.get(key, now)
            if ok:
                found[pos] = self.snap_time.get(key, now)
            return ok

        plan = pol.plan(
            hit, window=g.window, num_layers=g.num_layers, align=g.align, has_snapshot=has_snapshot
        )
        adopted = plan.hit_tokens
        source = plan.snapshot_source or (WindowSource.REPLAY if adopted else WindowSource.NONE)
        if plan.snapshot_source is WindowSource.SWA_POOL:
            self.ages.append(now - found[plan.snapshot_at])
        if hit and ids[hit // bs - 1] in self.boundaries:
            self.boundary_hits += 1
        self.sources[source] += 1
        dev_tokens = min(d * bs, adopted)
        result = RequestResult(dev_tokens, adopted - dev_tokens, source, plan.replay_tokens, n - adopted)
        self.results.append(result)
        t = self.totals
        t["prompt_tokens"] += n
        t["device_hit_tokens"] += result.device_tokens
        t["persistent_hit_tokens"] += result.persistent_tokens
        t["replayed_tokens"] += plan.replay_tokens
        t["computed_tokens"] += n - adopted

        flops = self.cost.replay_flops(plan.replay_start, adopted) + self.cost.prefill_flops(
            adopted, n, decoder_every_row=not pol.decoder_replay
        )
        self.flops += flops
        prefill_end = now + self.cost.seconds(flops)
        last = n + max(req.output_tokens, 1) - 1  # tokens in the cache at finish (the last is not fed)
        finish = prefill_end + req.output_tokens / sc.output_tok_s
        # blocks past the prompt's full ones (the straddling block, output blocks, a partial last block):
        # never named by the trace, so unique; they occupy the device pool like any other block
        tail_ids = [next(self.unique) for _ in range(-(-last // bs) - full)]

        every = ids + tail_ids
        self._touch(every[: adopted // bs], now)
        prompt_blocks = -(-n // bs)
        self._at(prefill_end, lambda at: self._write_blocks(every, adopted // bs, full, at, prompt_blocks))
        self._at(finish, lambda at: self._write_blocks(every, full, last // bs, at, -(-last // bs), 0))
        self._snapshots(every, n, last, plan, prefill_end, finish)

    def _touch(self, ids: list[int], now: float) -> None:
        """Make ``ids`` the most recently used device blocks, the first one last."""
        self.device.touch(ids[::-1], self.geo.block_bytes, now)

    def _write_blocks(
        self, ids: list[int], first: int, end: int, now: float, held: int, touch_from: int | None = None
    ) -> None:
        """Blocks ``[first, end)`` filled: written through to the persistent tier. The device pool gets the
        request's blocks ``[touch_from, held)`` (default ``first``) as the most recently used, the first one
        last (as `BlockPool.release` frees a table last block first, so a prefix's head outlives its tail)."""
        g, full_store = self.geo, self.sc.policy.store is WindowSource.WINDOW_BLOCKS
        for i in range(first, end):
            self.persistent.put((KeyKind.BLOCK, ids[i]), g.block_bytes, now)
            if full_store:
                self.persistent.put((KeyKind.WINDOW_BLOCK, ids[i]), g.window_block_bytes, now)
        self._touch(ids[first if touch_from is None else touch_from : held], now)

    def _snapshots(
        self, ids: list[int], n: int, last: int, plan: RestorePlan, t_prefill: float, t_end: float
    ) -> None:
        """Queue the window snapshots the engine would store (module docstring, step 3), and record the
        request's prompt and output boundaries whatever the policy stores (for `boundary_hits`)."""
        pol, bs, adopted = self.sc.policy, self.geo.block_size, plan.hit_tokens
        # the state at H is stored only if a forward recomputed it exactly (not restored, not clipped)
        at_hit = plan.replay_tokens > 0 and not plan.clipped
        prompt_boundary = (n - 1) // bs * bs
        final = last // bs * bs
        for pos, when, store in (
            (
                prompt_boundary,
                t_prefill,
                prompt_boundary > adopted or (prompt_boundary == adopted and at_hit),
            ),
            (final, t_end, final > max(prompt_boundary, adopted)),
        ):
            if pos > 0:
                self._at(when, lambda at, pos=pos, store=store: self._boundary(ids, pos, at, store))
        for pos in pol.checkpoints(last):
            if pos > adopted or (pos == adopted and at_hit):
                self._at(t_prefill if pos <= n else t_end, lambda at, pos=pos: self._store(ids, pos, at))

    def _boundary(self, ids: list[int], pos: int, now: float, store: bool) -> None:
        key = ids[pos // self.geo.block_size - 1]
        self.boundaries.add(key)
        if store and self.sc.policy.stores_boundaries:
            self._store(ids, pos, now)

    def _store(self, ids: list[int], pos: int, now: float) -> None:
        """Store the window snapshot at ``pos`` (SWA pool for bounded-replay, else the persistent tier)."""
        store = self.sc.policy.store
        key = (KeyKind.snapshot_in(store), ids[pos // self.geo.block_size - 1])
        tier = self.swa if store is WindowSource.SWA_POOL else self.persistent
        if tier.put(key, self.geo.snapshot_bytes, now):
            self.totals["snapshots_stored"] += 1
            self.snap_time[key] = now

    # --- totals ---

    def _summary(self) -> dict[str, object]:
        t, g = dict(self.totals), self.geo
        kinds = self.persistent.kind_bytes
        prompt = t["prompt_tokens"] or 1
        t["persistent_bytes_written"] = self.persistent.bytes_written
        t["swa_pool_bytes_written"] = self.swa.bytes_written
        ages = sorted(self.ages)
        pool_restores = self.sources[WindowSource.SWA_POOL]
        stored = (
            pool_restores + self.sources[WindowSource.PERSISTENT] + self.sources[WindowSource.WINDOW_BLOCKS]
        )
        return t | {
            "requests": len(self.results),
            "device_hit_ratio": round(t["device_hit_tokens"] / prompt, 6),
            "persistent_hit_ratio": round(t["persistent_hit_tokens"] / prompt, 6),
            "hit_ratio": round((t["device_hit_tokens"] + t["persistent_hit_tokens"]) / prompt, 6),
            "window_sources": dict(self.sources),
            "hit_requests": self.hits,
            "boundary_hits": self.boundary_hits,
            "swa_pool_catch_ratio": round(pool_restores / self.boundary_hits, 6)
            if self.boundary_hits
            else 0.0,
            "stored_window_ratio": round(stored / self.boundary_hits, 6) if self.boundary_hits else 0.0,
            "snapshot_age_p50_s": _pct(ages, 0.5),
            "snapshot_age_p90_s": _pct(ages, 0.9),
            "recomputed_tokens": t["replayed_tokens"] + t["computed_tokens"],
            "prefill_flops": self.flops,
            "prefill_gpu_s": round(self.cost.seconds(self.flops), 3),
            "persistent_bytes_resident": self.persistent.nbytes,
            "persistent_kv_bytes": kinds.get(KeyKind.BLOCK, 0),
            "persistent_window_bytes": kinds.get(KeyKind.SNAPSHOT, 0) + kinds.get(KeyKind.WINDOW_BLOCK, 0),
            "persistent_entries": len(self.persistent),
            "persistent_evictions": self.persistent.evictions,
            "persistent_expirations": self.persistent.expirations,
            "swa_pool_evictions": self.swa.evictions,
            "swa_pool_expirations": self.swa.expirations,
            "device_blocks": self.device.capacity // g.block_bytes if self.device.capacity else 0,
            "block_bytes": g.block_bytes,
            "snapshot_bytes": g.snapshot_bytes,
            "cost_formula": self.cost.formula,
        }


def _pct(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None
