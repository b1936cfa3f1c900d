"""Model-free trace replay: the cache tiers of a serving instance simulated in trace time, no model run.

Each request of a `Trace` goes through the same control plane as the engine
(`kvdiet.cache.control.ControlPlane`: lookup, restore plan, write-through, capture points, what is stored
where) on tiers whose values are byte sizes (`kvdiet.sim.size_tier.SizeTier`: the TTL and LRU rules of
`kvdiet.cache.ttl_lru.TtlLru`, the in-process SWA pool's own; a global-KV DRAM tier between the device pool
and the persistent tier when ``SimConfig.global_pool_bytes`` > 0). This module only executes the plans with
sizes, keeps trace time and adds up what happened; there is no second copy of any cache rule here.

Trace time: a request's lookup happens at its arrival; its prefill (from the plan's replay start to the
prompt's end: one `ControlPlane.after_forward`) ends ``prefill GPU-seconds`` later (the `kvdiet.sim.cost`
model) and its decode (to the output's end, then `ControlPlane.finish`) ``output_tokens / output_tok_s``
after that. Blocks and snapshots are stored at those times; TTLs count from them.

The device pool is `kvdiet.sim.device_tree.DeviceTree`: the blocks held form a tree of chains evicted least
recently used leaf first, the order `kvdiet.cache.block_pool.BlockPool` keeps (it frees a table last block
first, so a prefix's head outlives its tail); a lookup, and each forward's end, uses the request's blocks from
the root. Its cost grows with the blocks a request adds, not with its prompt. Not modelled: the blocks a
running request pins (a block evicted between its request's prefill and finish is added again at the
finish), persistent-entry header bytes (payload only), and any reuse of output blocks — the trace's ids cover
prompts only, so an output block is never hit. A trace without ids (Azure) gives every prompt unique
blocks.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import os
from collections.abc import Callable, Hashable, Sequence
from typing import NoReturn

from kvdiet.cache.control import CacheRequest, ControlPlane, Geometry, prompt_boundary
from kvdiet.cache.keys import IdKeys
from kvdiet.cache.plan import Provenance, RestoreWindow, WindowSource
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import ModelConfig
from kvdiet.sim.breakdown import Breakdown, GroupFigures
from kvdiet.sim.cost import CostModel
from kvdiet.sim.device_tree import DeviceTree
from kvdiet.sim.reblock import engine_block_size, reblock
from kvdiet.sim.records import SimConfig, SimResult
from kvdiet.sim.size_tier import SizeTier, TraceClock, class_bytes, tier_bytes
from kvdiet.sim.traces import Trace

__all__ = ["request_blocks", "simulate", "simulate_then_exit"]


def simulate(
    trace: Trace,
    config: SimConfig,
    *,
    progress: Callable[[int], None] | None = None,
    blocks: Sequence[tuple[int, ...]] | None = None,
) -> SimResult:
    """Replay ``trace`` through the tiers of ``config`` (see the module docstring).

    Args:
        trace: requests in arrival order, run at the model's engine's block size (`kvdiet.sim.reblock`).
        config: sizes, TTLs, policy, cost model.
        progress: called with the number of requests done, every 1,000 and at the end.
        blocks: `request_blocks` of ``trace`` at that block size when the caller has them (a study).
    Raises ValueError: from `SimConfig.check`; ``blocks`` with a trace not at that block size.
    """
    cfg = config.check(trace.block_size)
    trace = trace if blocks is not None else reblock(trace, engine_block_size(cfg, trace.block_size))
    collecting = gc.isenabled()
    gc.disable()  # millions of small, acyclic entries: cycle collection would rescan them all, for nothing
    run = _Run(trace, config, cfg, progress, blocks)
    try:
        return run.run()
    finally:
        run.close()  # freed now, by reference counts: left to the cycle collector, that costs a third more
        del run
        if collecting:
            gc.enable()


def request_blocks(trace: Trace) -> list[tuple[int, ...]]:
    """Each request's blocks as the simulator holds them: the trace's ids of its prompt's full blocks, then
    one id of its own for each other block it fills up to its output's end (the straddling block, the output,
    a prompt the trace gives no ids: never named by the trace, so never hit), counting down from −1 across
    the trace. The same for every run of a trace."""
    out, unique, bs = [], -1, trace.block_size
    for req in trace.requests:
        named = (req.hash_ids or ())[: (n := req.input_tokens) // bs]
        fresh = -(-(n + max(req.output_tokens, 1) - 1) // bs) - len(named)  # to the cache's last token
        out.append(named + tuple(range(unique, unique - fresh, -1)))
        unique -= fresh
    return out


def simulate_then_exit(
    trace: Trace, config: SimConfig, send: Callable[[object], None], blocks: Sequence[tuple[int, ...]]
) -> NoReturn:
    """`simulate` with ``blocks`` in a process that ends with it (a study's forked worker):
    ``send((True, result))`` or ``send((False, exception))``, then the process exits at once, exit code 0 (1
    when ``send`` failed), its run never freed entry by entry (the OS takes the memory back whole: freeing
    costs up to a tenth of a run); garbage collection stays off."""
    gc.disable()
    try:
        run = _Run(trace, config, config.check(trace.block_size), None, blocks)
        out: tuple[bool, object] = (True, run.run())
    except Exception as e:  # sent to the parent, which raises it
        out = (False, e)
    try:
        send(out)
    except BaseException:
        os._exit(1)
    os._exit(0)


class _Run:
    def __init__(self, trace: Trace, sc: SimConfig, cfg: ModelConfig, progress, blocks) -> None:
        if (bs := engine_block_size(cfg, trace.block_size)) != trace.block_size:  # a caller's blocks
            raise ValueError(f"{sc.model} runs at {bs}-token blocks, not the trace's {trace.block_size}")
        self.trace, self.sc, self.progress = trace, sc, progress
        self.blocks = request_blocks(trace) if blocks is None else blocks
        self.geo = g = Geometry.from_config(cfg, trace.block_size)
        self.snapshot_sizes = CacheSpec.from_config(cfg).snapshot_sizes()
        self.window_block = lambda i: g.window_block_bytes  # a block's window entries (full-store)
        self.cost = CostModel(cfg, sc.gpu, sc.mfu)
        self.decoder_every_row = not sc.policy.decoder_replay
        self.clock = TraceClock(trace.requests[0].arrival_s if trace.requests else 0.0)
        self.device = DeviceTree(sc.device_bytes)
        self.persistent = SizeTier(sc.persistent_bytes, sc.persistent_ttl_s, refresh=False, clock=self.clock)
        self.swa = SizeTier(sc.swa_pool_bytes, sc.swa_pool_ttl_s, refresh=True, clock=self.clock)
        self.glob = (  # Mooncake's upsert restarts a block's TTL: refresh
            SizeTier(sc.global_pool_bytes, sc.global_pool_ttl_s, refresh=True, clock=self.clock)
            if sc.has_global_pool
            else None
        )
        self.control: ControlPlane[int] = ControlPlane(
            sc.policy,
            g,
            IdKeys(),
            persistent=self.persistent,
            swa_pool=self.swa,
            global_pool=self.glob,
            device=self.device.counters,
            prefix_caching=sc.prefix_caching,
            supersede=sc.swa_pool_supersede,
            on_supersede=self._superseded,
        )
        self.older: set[object] = set()  # pool snapshot keys a newer snapshot of their chain followed
        self.restores_of_older = 0  # pool restores of such a snapshot
        self.events: list[tuple[float, int, tuple, bool]] = []  # time, order, `_forward`'s arguments, finish
        self.seq = itertools.count()
        self.lookup_tokens = 0
        self.sources = dict.fromkeys(WindowSource, 0)
        self.flops = 0.0
        # prefix ids at which an earlier request's prompt or output ended
        self.boundaries: set[Hashable] = set()
        self.boundary_hits = 0  # requests whose hit H ends at such a boundary (where a snapshot can be)
        self.hits = 0  # requests with any global-KV hit
        self.ages: list[float] = []
        self.results: list[Provenance] = []
        self.breakdown = Breakdown()

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
        for i, (req, every) in enumerate(zip(reqs, self.blocks, strict=True)):
            while mark < n - 1 and marks[mark] < req.arrival_s:
                self._sample(marks[mark], series, window)
                mark += 1
            self._advance(req.arrival_s)
            result = self._request(req, every)
            window[0] += req.input_tokens
            window[1] += result.device_tokens
            window[2] += result.persistent_tokens
            if self.progress is not None and (i + 1) % 1000 == 0:
                self.progress(i + 1)
        while mark < n:
            self._sample(marks[mark], series, window)
            mark += 1
        self._advance(math.inf)  # finish everything still running (their stores count)
        if self.progress is not None:
            self.progress(len(reqs))
        return SimResult(self.sc, self._summary(), series, self.results, self.ages)

    def close(self) -> None:
        """Drop the tiers' entries and the control plane's callback: nothing of the run left in a cycle."""
        self.device.clear()
        self.persistent.close()
        self.swa.close()
        if self.glob is not None:
            self.glob.close()
        self.control.on_supersede = None
        self.events.clear()

    def _sample(self, t: float, series: dict[str, list[float]], window: list[int]) -> None:
        self._advance(t)
        self.clock.t = max(self.clock.t, t)
        self._expire()
        prompt = window[0]
        series["t_s"].append(round(t, 3))
        series["device_hit"].append(round(window[1] / prompt, 6) if prompt else 0.0)
        series["persistent_hit"].append(round(window[2] / prompt, 6) if prompt else 0.0)
        series["persistent_bytes"].append(self.persistent.nbytes)
        series["swa_pool_bytes"].append(self.swa.nbytes)
        window[:] = [0, 0, 0]

    def _expire(self) -> None:
        for tier in (self.persistent, self.swa, self.glob):
            if tier is not None:
                tier.expire()

    def _advance(self, now: float) -> None:
        events, clock, forward = self.events, self.clock, self._forward
        while events and events[0][0] <= now:
            t, _, args, finish = heapq.heappop(events)
            if t > clock.t:
                clock.t = t
            forward(*args, finish=finish)
        if now != math.inf and now > clock.t:
            clock.t = now

    # --- one request: the control plane's steps, executed with sizes ---

    def _request(self, req, every: tuple[int, ...]) -> Provenance:
        g, control = self.geo, self.control
        bs, n, now = g.block_size, req.input_tokens, req.arrival_s
        last = n + max(req.output_tokens, 1) - 1  # tokens in the cache at finish (the last is not fed)
        cached: CacheRequest[int] = CacheRequest(n, every)

        usable = control.usable_blocks(n)
        d = self.device.match(every, usable)
        loaded = control.load(cached, d, usable, _accept)
        found = d + loaded.blocks
        plan, window = control.plan(cached, found)
        result = control.admit(cached, plan, device_blocks=d, loaded=loaded)
        self.results.append(result)
        groups = self.breakdown.groups(n, req.kind, req.session)
        self.breakdown.add_request(groups, result)

        hit, adopted = found * bs, plan.hit_tokens
        self.lookup_tokens += usable * bs
        self.hits += hit > 0
        if hit and every[hit // bs - 1] in self.boundaries:
            self.boundary_hits += 1
        self.sources[result.window_source] += 1
        if isinstance(window, RestoreWindow) and window.source is WindowSource.SWA_POOL:
            self.ages.append(now - self.swa.entries.written_at(window.keys[0]))
            self.restores_of_older += window.keys[0] in self.older

        cost = self.cost
        flops = cost.replay_flops(plan.replay_start, adopted) + cost.prefill_flops(
            adopted, n, decoder_every_row=self.decoder_every_row
        )
        self.flops += flops
        prefill_end = now + cost.seconds(flops)
        finish = prefill_end + req.output_tokens / self.sc.output_tok_s

        self.device.use(every, adopted // bs, g.payloads, guess=d)
        held = max(d, adopted // bs)  # blocks held now: the likely start of the prompt's blocks to add
        events, seq = self.events, self.seq
        heapq.heappush(events, (prefill_end, next(seq), (cached, groups, plan.replay_start, n, held), False))
        heapq.heappush(events, (finish, next(seq), (cached, groups, n, last, -(-n // bs)), True))
        return result

    def _forward(
        self,
        cached: CacheRequest[int],
        groups: tuple[GroupFigures, ...],
        start: int,
        end: int,
        held: int,
        *,
        finish: bool = False,
    ) -> None:
        """The forward over ``[start, end)`` is done: the control plane writes and captures (sizes for
        payloads); the request's blocks up to the last one it holds become the device pool's most recently
        used (``held``: how many of them the pool likely holds already); the boundary reached is recorded
        (for ``boundary_hits``)."""
        g, bs, persistent, swa = self.geo, self.geo.block_size, self.persistent.counters, self.swa.counters
        written = (persistent.bytes_written, swa.bytes_written)
        sizes = self.snapshot_sizes
        self.control.after_forward(
            cached, start, end, blocks=g.payloads, window_block=self.window_block, snapshot=sizes
        )
        self.device.use(cached.blocks, -(-end // bs), g.payloads, guess=held)
        boundary = end // bs * bs if finish else prompt_boundary(end, bs)
        if boundary > 0:
            self.boundaries.add(cached.blocks[boundary // bs - 1])
        if finish:
            self.control.finish(cached)
        self.breakdown.add_bytes(
            groups, persistent.bytes_written - written[0], swa.bytes_written - written[1]
        )

    def _superseded(self, new_key: object, older: list[object]) -> None:
        self.older.update(older)
        self.older.discard(new_key)

    # --- totals ---

    def _summary(self) -> dict[str, object]:
        g, stats, results = self.geo, self.control.stats, self.results
        self._expire()  # byte-hours run to the last event (the last request's end)
        reqs = self.trace.requests
        span = self.clock.now() - (reqs[0].arrival_s if reqs else 0.0)
        kinds = class_bytes(self.persistent)
        t = {
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "lookup_tokens": self.lookup_tokens,
            "device_hit_tokens": sum(r.device_tokens for r in results),
            "persistent_hit_tokens": sum(r.persistent_tokens for r in results),
            "replayed_tokens": stats.replayed_tokens,
            "computed_tokens": stats.computed_tokens,
            "snapshots_stored": stats.snapshots_stored,
            "persistent_bytes_written": self.persistent.counters.bytes_written,
            "swa_pool_bytes_written": self.swa.counters.bytes_written,
        }
        prompt = t["prompt_tokens"] or 1
        ages = sorted(self.ages)
        pool_restores = self.sources[WindowSource.SWA_POOL]
        stored = (
            pool_restores + self.sources[WindowSource.PERSISTENT] + self.sources[WindowSource.WINDOW_BLOCKS]
        )
        return (
            t
            | {
                "requests": len(results),
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
                "pool_restores_of_older_snapshots": self.restores_of_older,
                "snapshot_age_p50_s": _pct(ages, 0.5),
                "snapshot_age_p90_s": _pct(ages, 0.9),
                "recomputed_tokens": t["replayed_tokens"] + t["computed_tokens"],
                "prefill_flops": self.flops,
                "prefill_gpu_s": round(self.cost.seconds(self.flops), 3),
                "persistent_bytes_resident": self.persistent.nbytes,
                "persistent_kv_bytes": kinds.get("kv", 0),
                "persistent_window_bytes": kinds.get("window", 0),
                "persistent_entries": len(self.persistent),
                "persistent_evictions": self.persistent.counters.evictions,
                "persistent_expirations": self.persistent.counters.expirations,
                "swa_pool_evictions": self.swa.counters.evictions,
                "swa_pool_expirations": self.swa.counters.expirations,
                **tier_bytes(self.persistent, "persistent", span),
                **tier_bytes(self.swa, "swa_pool", span),
                "span_s": round(span, 3),
                "device_blocks": self.device.capacity // g.block_bytes,  # mean size
                "block_size": g.block_size,
                "block_bytes": g.block_bytes,
                "cost_formula": self.cost.formula,
                **self.breakdown.as_dict(),
            }
            | self._global_summary(results, prompt, span)
        )

    def _global_summary(self, results: list[Provenance], prompt: int, span: float) -> dict[str, object]:
        """The global pool's figures (none without one: a run without it reports what it always did); the
        global-pool hits are then part of ``hit_ratio`` too."""
        tier = self.glob
        if tier is None:
            return {}
        hits = sum(r.global_pool_tokens for r in results)
        device, persistent = (
            sum(getattr(r, f) for r in results) for f in ("device_tokens", "persistent_tokens")
        )
        return {
            "global_pool_hit_tokens": hits,
            "global_pool_hit_ratio": round(hits / prompt, 6),
            "hit_ratio": round((device + hits + persistent) / prompt, 6),
            "global_pool_entries": len(tier),
            "global_pool_evictions": tier.counters.evictions,
            "global_pool_expirations": tier.counters.expirations,
            **tier_bytes(tier, "global_pool", span),
        }


def _accept(i: int, payload: int) -> bool:
    """A block loaded from a lower tier is taken into the device pool (`DeviceTree.use` makes room)."""
    return True


def _pct(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None
