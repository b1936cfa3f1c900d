"""`ControlPlane`: every cache rule, once — lookup across tiers, the restore plan, capture points, what is
stored where — for the engine (values are bytes) and the simulator (values are byte sizes) alike.

DESIGN.md §2–§3. The control plane decides and talks to the byte tiers through `kvdiet.cache.tier.Tier`;
its executor does what needs the device: the engine's runner (`kvdiet.engine.runner`) with tensors, the
model-free simulator (`kvdiet.sim.model_free`) with sizes. A request goes through:

1. `ControlPlane.usable_blocks` — how many prompt blocks may hit (the last token is always computed);
   the executor takes the longest prefix of them from its device pool;
2. `ControlPlane.load` — the run of the next blocks the persistent tier's index holds, read in
   batches; the executor accepts each payload into its device pool until a read misses or the pool is full;
3. `ControlPlane.plan` — the policy's `RestorePlan` at the hit, probing the tier the policy keeps window
   state in, and the window action: `RestoreWindow` (payloads fetched) or `Replay`; on a payload that
   fails validation the executor calls `ControlPlane.plan` again with ``use_stored=False``;
4. `ControlPlane.admit` — counts the lookup and returns the `Provenance`;
5. after every forward that computed positions ``[start, end)``, `ControlPlane.after_forward` — writes the
   blocks filled since through to the persistent tier (with their window entries under ``full-store``)
   and captures window state at the block boundaries the policy keeps (`SwaPolicy.capture_at`): stored at
   once or held for `ControlPlane.finish`. The executor stops prefill chunks at `ControlPlane.capture_points`
   so each capture falls at a forward's end.

Plain data: no torch, no clock (the tiers keep time), no I/O of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain, cycle, islice
from typing import Generic, TypeVar

from kvdiet.cache.counters import CacheStats, TierCounters
from kvdiet.cache.keys import KeyKind, KeyScheme
from kvdiet.cache.plan import COLD, Provenance, Replay, RestorePlan, RestoreWindow, WindowSource
from kvdiet.cache.policies import Capture, SwaPolicy
from kvdiet.cache.spec import CacheSpec
from kvdiet.cache.tier import Tier, value_bytes
from kvdiet.config import ModelConfig
from kvdiet.layer_plan import LayerPlan

__all__ = ["LOAD_BATCH", "CacheRequest", "ControlPlane", "Geometry", "prompt_boundary"]

V = TypeVar("V")

LOAD_BATCH = 32
"""Blocks read from the persistent tier per batch (one index transaction each), so a broken chain stops
the reads early."""


def prompt_boundary(prompt_tokens: int, block_size: int) -> int:
    """The prompt's last full-block boundary that leaves its last token to compute: ``(N − 1) // B × B``."""
    return (prompt_tokens - 1) // block_size * block_size


@dataclass(frozen=True, slots=True)
class Geometry:
    """The sizes the rules need (tokens and bytes).

    Attributes:
        block_size: tokens per block (B).
        window: sliding window W (tokens).
        num_layers: layers with a window ring.
        align: replay starts are multiples of this (lcm of the compress ratios of the KV sources).
        block_bytes: one block's global KV payload (bytes); the mean over `block_cycle` when blocks differ.
        window_block_bytes: one block's window entries of every layer (``full-store`` payload, bytes).
        block_cycle: the payload of blocks ``0, 1, …`` repeating, when a compress ratio does not divide the
            block size (V4-Flash's HCA, ratio 128, at 64-token blocks: an entry spans two blocks and is counted
            in the block where its group completes); empty when every block holds ``block_bytes``.
    """

    block_size: int
    window: int
    num_layers: int
    align: int
    block_bytes: int
    window_block_bytes: int
    block_cycle: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: ModelConfig, block_size: int) -> Geometry:
        """The geometry of the packed cache formats of ``cfg`` (`CacheSpec`) at ``block_size``: block i holds
        the entries whose compression group completes in it, ``global_bytes((i + 1)·B) − global_bytes(i·B)``.

        Raises:
            ValueError: ``block_size`` < 1.
        """
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 token, got {block_size}")
        spec, plan = CacheSpec.from_config(cfg), LayerPlan.from_config(cfg)
        ratios = [plan[s].compress_ratio for s in plan.kv_sources]
        period = math.lcm(block_size, *ratios) // block_size  # blocks after which the layout repeats
        sizes = tuple(
            spec.global_bytes((i + 1) * block_size) - spec.global_bytes(i * block_size) for i in range(period)
        )
        return cls(
            block_size=block_size,
            window=cfg.sliding_window,
            num_layers=len(plan.layers),
            align=math.lcm(*ratios),
            block_bytes=round(sum(sizes) / period),
            window_block_bytes=block_size * spec.window_entry_bytes_per_token,
            block_cycle=sizes if len(set(sizes)) > 1 else (),
        )

    def payload_bytes(self, block: int) -> int:
        """Global KV bytes of block ``block`` (0-based) of a request."""
        return self.block_cycle[block % len(self.block_cycle)] if self.block_cycle else self.block_bytes

    def payloads(self, first: int, end: int) -> list[int]:
        """`payload_bytes` of blocks ``[first, end)``."""
        if not self.block_cycle:
            return [self.block_bytes] * max(0, end - first)
        start = first % len(self.block_cycle)
        return list(islice(cycle(self.block_cycle), start, start + max(0, end - first)))


@dataclass(slots=True)
class CacheRequest(Generic[V]):
    """One request as the control plane sees it.

    Attributes:
        prompt_tokens: N.
        blocks: the identity of each full block known so far, in order (chained hashes in the engine, which
            appends them as blocks fill; trace ids in the simulator, all known up front).
        block_tokens: each full block's token ids (checked back by the persistent tier), or None (simulator).
        plan: the adopted restore plan (set by `ControlPlane.admit`).
        persisted: leading blocks known to be in the persistent tier (written through or hit).
        held: window state captured to store when the request finishes: ``(position, value)`` or None.
        pool_snapshots: keys of the SWA-pool snapshots of this request's chain it restored or stored, newest
            last (what a newer snapshot of the chain supersedes).
    """

    prompt_tokens: int
    blocks: Sequence[Hashable]
    block_tokens: list[Sequence[int]] | None = None
    plan: RestorePlan = COLD
    persisted: int = 0
    held: tuple[int, V] | None = None
    pool_snapshots: list[Hashable] = field(default_factory=list)

    def tokens(self, first: int, end: int) -> list[Sequence[int]] | None:
        return None if self.block_tokens is None else self.block_tokens[first:end]


@dataclass
class ControlPlane(Generic[V]):
    """The rules of one cache system (see the module docstring).

    Args:
        policy: the SWA policy.
        geometry: block size, window and payload sizes.
        keys: how tier keys derive from block identities.
        persistent: the persistent tier (None: none).
        swa_pool: the SWA pool (None: none; bounded-replay then always replays).
        device: the device pool's counters (query and hit tokens are counted here).
        prefix_caching: look prompts up at all (False: every request is cold; blocks are still written).
        supersede: a request's prompt-end SWA-pool snapshot replaces the one it restored
            (``swa_pool.discard_many``), so a session keeps its newest turn's snapshot. The output-end snapshot
            (stored at finish) replaces nothing: the next turn may continue from either end.
        on_supersede: called with ``(new_key, older_keys)`` whenever a request's prompt-end pool snapshot
            follows one of its chain (with or without ``supersede``): how a caller measures restores of a
            snapshot that was no longer its chain's newest.
    """

    policy: SwaPolicy
    geometry: Geometry
    keys: KeyScheme
    persistent: Tier[V] | None = None
    swa_pool: Tier[V] | None = None
    device: TierCounters = field(default_factory=TierCounters)
    prefix_caching: bool = True
    supersede: bool = False
    on_supersede: Callable[[Hashable, list[Hashable]], None] | None = None
    stats: CacheStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = CacheStats(
            self.device,
            self.persistent.counters if self.persistent is not None else TierCounters(),
            self.swa_pool.counters if self.swa_pool is not None else TierCounters(),
        )

    # --- lookup ---

    def usable_blocks(self, prompt_tokens: int) -> int:
        """Prompt blocks a lookup may adopt: ``(N − 1) // B`` (the last token's logits are needed), 0 when
        prefix caching is off."""
        return (prompt_tokens - 1) // self.geometry.block_size if self.prefix_caching else 0

    def load(self, req: CacheRequest[V], first: int, end: int, accept: Callable[[int, V], bool]) -> int:
        """Load blocks ``[first, end)`` of ``req`` from the persistent tier: the run its index
        holds, read `LOAD_BATCH` at a time; ``accept(i, payload)`` takes block ``i`` into the device pool and
        returns False when it cannot (pool full). Stops at the first miss, wrong-sized payload or refusal;
        returns how many blocks were accepted."""
        tier = self.persistent
        if tier is None or first >= end:
            return 0
        keys = self.keys.keys(req.blocks[first:end], KeyKind.BLOCK)
        present = tier.contains_prefix(keys)
        done = 0
        for s in range(0, present, LOAD_BATCH):
            batch = keys[s : min(s + LOAD_BATCH, present)]  # nothing past the run: no read, no LRU move
            payloads = tier.get_many(batch, req.tokens(first + s, first + s + len(batch)))
            for payload in payloads:
                if payload is None or value_bytes(payload) != self.geometry.payload_bytes(first + done):
                    return done
                if not accept(first + done, payload):
                    return done
                done += 1
        return done

    def plan(
        self, req: CacheRequest[V], hit_blocks: int, *, use_stored: bool = True
    ) -> tuple[RestorePlan, RestoreWindow[V] | Replay | None]:
        """The policy's plan for a hit of ``hit_blocks`` blocks and its window action: `RestoreWindow` with the
        payloads read while probing, `Replay` of ``[start, H)``, or None (cold). ``use_stored=False`` plans as
        if no window state were stored (after a stored one failed validation)."""
        g, found = self.geometry, {}

        def has_snapshot(pos: int) -> bool:
            if not use_stored or pos <= 0 or pos % g.block_size:
                return False
            read = self._read_window(req, pos)
            if read is not None:
                found[pos] = read
            return read is not None

        plan = self.policy.plan(
            hit_blocks * g.block_size,
            window=g.window,
            num_layers=g.num_layers,
            align=g.align,
            has_snapshot=has_snapshot,
        )
        if plan.snapshot_source is not None:
            keys, payloads = found[plan.snapshot_at]
            return plan, RestoreWindow(plan.snapshot_at, plan.snapshot_source, keys, payloads)
        if plan.hit_tokens:
            return plan, Replay(plan.replay_start, plan.hit_tokens, plan.clipped)
        return plan, None

    def _read_window(self, req: CacheRequest[V], pos: int) -> tuple[tuple, tuple] | None:
        """The stored window state at ``pos`` in the policy's tier: ``(keys, payloads)`` or None."""
        g, store = self.geometry, self.policy.store
        i = pos // g.block_size - 1
        if store is WindowSource.WINDOW_BLOCKS:
            keys, payloads = [], []
            for j in range(max(0, pos - g.window) // g.block_size, pos // g.block_size):
                data = self._get(self.persistent, req, j, KeyKind.WINDOW_BLOCK)
                if data is None or value_bytes(data) != g.window_block_bytes:
                    return None  # one missing block: no window state here (and nothing more read)
                keys.append(self.keys.key(req.blocks[j], KeyKind.WINDOW_BLOCK))
                payloads.append(data)
            return tuple(keys), tuple(payloads)
        kind = self._snapshot_kind()
        if kind is None:
            return None
        data = self._get(self._snapshot_tier(), req, i, kind)
        return None if data is None else ((self.keys.key(req.blocks[i], kind),), (data,))

    def _get(self, tier: Tier[V] | None, req: CacheRequest[V], i: int, kind: KeyKind) -> V | None:
        if tier is None:
            return None
        tokens = req.tokens(i, i + 1) if tier is self.persistent else None
        return tier.get_many([self.keys.key(req.blocks[i], kind)], tokens)[0]

    def corrupt(self, window: RestoreWindow[V]) -> None:
        """Count a restored payload the executor found invalid (it then plans with ``use_stored=False``)."""
        tier = self.stats.swa_pool if window.source is WindowSource.SWA_POOL else self.stats.persistent
        tier.corrupt_dropped += 1

    def admit(
        self, req: CacheRequest[V], plan: RestorePlan, *, device_blocks: int, loaded_blocks: int
    ) -> Provenance:
        """Adopt ``plan`` for ``req``, whose lookup took ``device_blocks`` blocks from the device pool and loaded
        ``loaded_blocks`` from the persistent tier: count the lookup and the work, and return the request's
        `Provenance`."""
        g, s = self.geometry, self.stats
        n, bs = req.prompt_tokens, g.block_size
        usable, hit = self.usable_blocks(n), plan.hit_tokens
        req.plan, req.persisted = plan, hit // bs
        s.device.query_tokens += usable * bs
        s.device.hit_tokens += device_blocks * bs
        if self.persistent is not None:
            s.persistent.query_tokens += (usable - device_blocks) * bs
            s.persistent.hit_tokens += loaded_blocks * bs
        if self.policy.store is WindowSource.SWA_POOL and hit:
            s.swa_pool.query_tokens += min(g.window, hit)
            if plan.snapshot_source is WindowSource.SWA_POOL:
                s.swa_pool.hit_tokens += min(g.window, hit)
        s.snapshot_restores += plan.snapshot_source is not None
        if plan.snapshot_source is WindowSource.SWA_POOL:
            req.pool_snapshots = [self.keys.key(req.blocks[hit // bs - 1], KeyKind.POOL_SNAPSHOT)]
        s.replayed_tokens += plan.replay_tokens
        s.computed_tokens += n - hit
        return Provenance.of(plan, prompt_tokens=n, device_tokens=device_blocks * bs, window=g.window)

    # --- the write path ---

    def capture_points(self, prompt_tokens: int) -> list[int]:
        """Positions (tokens, ascending) where prefill chunks must end so window state can be captured there:
        the prompt's last two block boundaries and the policy's checkpoints."""
        bs, n = self.geometry.block_size, prompt_tokens
        points = {prompt_boundary(n, bs), n // bs * bs} - {0}
        return sorted(points | set(self.policy.checkpoints(n)))

    def after_forward(
        self,
        req: CacheRequest[V],
        start: int,
        end: int,
        *,
        blocks: Callable[[int, int], Sequence[V]],
        window_block: Callable[[int], V | None],
        snapshot: Callable[[int], V],
    ) -> None:
        """A forward computed positions ``[start, end)`` of ``req`` (whose ``blocks`` cover ``end // B``).

        Writes blocks ``[req.persisted, end // B)`` through to the persistent tier (``blocks(i, j)`` gives the
        payloads of blocks ``[i, j)``; under ``full-store``, ``window_block(i)`` block i's window entries or
        None), then captures the window state at each block boundary in ``(start, end]`` the policy keeps:
        ``snapshot(pos)`` is the state at ``pos``. A restored hit is not captured again (positions ≤ H are
        never reached). After a
        bounded (clipped) replay from S, no state is captured before ``S + W + (L−1)(W−1)``: the windows there
        still read the entries the replay computed without their history (approximate), and a stored state
        is restored as exact.
        """
        bs, full = self.geometry.block_size, end // self.geometry.block_size
        if full > req.persisted:
            self._write_through(req, full, blocks, window_block)
        plan, boundary, g = req.plan, prompt_boundary(req.prompt_tokens, bs), self.geometry
        exact_from = plan.hit_tokens
        if plan.clipped:  # the receptive field of L window layers past the replay start (vLLM PR #57281)
            exact_from = max(exact_from, plan.replay_start + g.window + (g.num_layers - 1) * (g.window - 1))
        lo = (start // bs + 1) * bs
        for pos in self.policy.capture_candidates(lo, end, block_size=bs, prompt_boundary=boundary):
            if pos < exact_from or (plan.clipped and pos == plan.hit_tokens):
                continue
            capture = self.policy.capture_at(pos, prompt_boundary=boundary)
            if capture is Capture.NOW:
                self._store_snapshot(req, pos, snapshot(pos))
            elif capture is Capture.AT_FINISH:
                req.held = (pos, snapshot(pos))  # the latest boundary past the prompt's wins

    def _write_through(
        self,
        req: CacheRequest[V],
        full: int,
        blocks: Callable[[int, int], Sequence[V]],
        window_block: Callable[[int], V | None],
    ) -> None:
        tier, first = self.persistent, req.persisted
        if tier is not None:
            ids = req.blocks[first:full]
            tokens = [None] * len(ids) if req.block_tokens is None else req.block_tokens[first:full]
            items = list(zip(self.keys.keys(ids, KeyKind.BLOCK), tokens, blocks(first, full), strict=True))
            if self.policy.store is WindowSource.WINDOW_BLOCKS:  # each block's window entries after it
                rows = list(map(window_block, range(first, full)))
                window = zip(self.keys.keys(ids, KeyKind.WINDOW_BLOCK), tokens, rows, strict=True)
                items = list(chain.from_iterable(zip(items, window, strict=True)))
                if None in rows:  # a block without window entries: its global KV only
                    items = [item for item in items if item[2] is not None]
            tier.put_many(items)
        req.persisted = full

    def finish(self, req: CacheRequest[V]) -> None:
        """Store the window state held for the request's end (once)."""
        if req.held is not None:
            pos, value = req.held
            req.held = None
            self._store_snapshot(req, pos, value, supersedes=False)

    def _snapshot_kind(self) -> KeyKind | None:
        store = self.policy.store
        if store is WindowSource.SWA_POOL:
            return KeyKind.POOL_SNAPSHOT
        return KeyKind.SNAPSHOT if store is WindowSource.PERSISTENT else None

    def _snapshot_tier(self) -> Tier[V] | None:
        return self.swa_pool if self.policy.store is WindowSource.SWA_POOL else self.persistent

    def _store_snapshot(self, req: CacheRequest[V], pos: int, value: V, *, supersedes: bool = True) -> None:
        kind, tier = self._snapshot_kind(), self._snapshot_tier()
        if kind is None or tier is None:
            return
        i = pos // self.geometry.block_size - 1
        tokens = None if req.block_tokens is None or tier is not self.persistent else req.block_tokens[i]
        key = self.keys.key(req.blocks[i], kind)
        pooled = kind is KeyKind.POOL_SNAPSHOT and supersedes
        older = [k for k in req.pool_snapshots if k != key] if pooled else []
        if older and self.supersede:
            tier.discard_many(older)  # replaced, never held beside the newer one
        stored = tier.put_many([(key, tokens, value)])
        self.stats.snapshots_stored += stored
        if stored and pooled:
            if older and self.on_supersede is not None:
                self.on_supersede(key, older)
            req.pool_snapshots = [key]
