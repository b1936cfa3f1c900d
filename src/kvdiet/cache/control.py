"""`ControlPlane`: every cache rule, once — lookup across tiers, the restore plan, capture points, what is
stored where — for the engine (values are bytes) and the simulator (values are byte sizes) alike.

DESIGN.md §2–§3. The control plane decides and talks to the byte tiers through `kvdiet.cache.tier.Tier`;
its executor does what needs the device: the engine's runner (`kvdiet.engine.runner`) with tensors, the
model-free simulator (`kvdiet.sim.model_free`) with sizes. A request goes through:

1. `ControlPlane.usable_blocks` — how many prompt blocks may hit (the last token is always computed);
   the executor takes the longest prefix of them from its device pool;
2. `ControlPlane.load` — the run of the next blocks the global pool holds, then the run the persistent
   tier's index holds from there, read in batches; the executor accepts each payload into its device pool
   until a read misses or the pool is full; a block from one of the two is copied into the other;
3. `ControlPlane.plan` — the policy's `RestorePlan` at the hit, probing the tier the policy keeps window
   state in, and the window action: `RestoreWindow` (payloads fetched) or `Replay`; on a payload that
   fails validation the executor calls `ControlPlane.plan` again with ``use_stored=False``;
4. `ControlPlane.admit` — counts the lookup and returns the `Provenance`;
5. after every forward that computed positions ``[start, end)``, `ControlPlane.after_forward` — writes the
   blocks filled since through to the global pool and the persistent tier (there with their window
   entries under ``full-store``)
   and captures window state at the block boundaries the policy keeps (`SwaPolicy.capture_at`): stored at
   once or held for `ControlPlane.finish`. The executor stops prefill chunks at `ControlPlane.capture_points`
   so each capture falls at a forward's end.

Plain data: no torch, no clock (the tiers keep time), no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import chain
from typing import Generic, NamedTuple, TypeVar, cast

from kvdiet.cache.counters import CacheStats, TierCounters
from kvdiet.cache.geometry import Geometry, prompt_boundary
from kvdiet.cache.keys import KeyKind, KeyScheme
from kvdiet.cache.plan import COLD, Provenance, Replay, RestorePlan, RestoreWindow, WindowSource
from kvdiet.cache.policies import Capture, SwaPolicy
from kvdiet.cache.tier import SwaPoolTier, Tier, value_bytes

__all__ = ["LOAD_BATCH", "CacheRequest", "ControlPlane", "Geometry", "Loaded", "prompt_boundary"]

V = TypeVar("V")

LOAD_BATCH = 32
"""Blocks read from a lower tier per batch (one index transaction or one Mooncake batch each), so a broken
chain stops the reads early."""


class Loaded(NamedTuple):
    """Blocks `ControlPlane.load` took into the device pool, by the tier they came from (counts of blocks)."""

    global_pool: int
    persistent: int

    @property
    def blocks(self) -> int:
        return self.global_pool + self.persistent


_NONE_LOADED = Loaded(0, 0)


class CacheRequest(Generic[V]):
    """One request as the control plane sees it.

    Attributes:
        prompt_tokens: N.
        blocks: the identity of each full block known so far, in order (chained hashes in the engine, which
            appends them as blocks fill; trace ids in the simulator, all known up front).
        block_tokens: each full block's token ids (checked back by the persistent tier), or None (simulator).
        plan: the adopted restore plan (set by `ControlPlane.admit`).
        persisted: leading blocks known to be in the lower tiers (global pool, persistent tier): written
            through, hit, or copied there by `ControlPlane.load`.
        held: window state captured to store when the request finishes: ``(position, value)`` or None.
        pool_snapshots: keys of the SWA-pool snapshots of this request's chain it restored or stored, newest
            last (what a newer snapshot of the chain supersedes).
    """

    # Plain generic classes, not dataclasses: mypyc (`kvdiet.sim.simcore`) cannot compile generic dataclasses.
    def __init__(
        self, prompt_tokens: int, blocks: Sequence[Hashable], block_tokens: list[Sequence[int]] | None = None
    ) -> None:
        self.prompt_tokens, self.blocks, self.block_tokens = prompt_tokens, blocks, block_tokens
        self.plan: RestorePlan = COLD
        self.persisted = 0
        self.held: tuple[int, V] | None = None
        self.pool_snapshots: list[Hashable] = []

    def tokens(self, first: int, end: int) -> list[Sequence[int]] | None:
        return None if self.block_tokens is None else self.block_tokens[first:end]


class ControlPlane(Generic[V]):
    """The rules of one cache system (see the module docstring).

    Args:
        policy: the SWA policy.
        geometry: block size, window and payload sizes.
        keys: how tier keys derive from block identities.
        persistent: the persistent tier (None: none).
        global_pool: the shared global-KV DRAM tier between the device pool and the persistent tier (None:
            none): read before the persistent tier, written through with it.
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

    def __init__(
        self,
        policy: SwaPolicy,
        geometry: Geometry,
        keys: KeyScheme,
        *,
        persistent: Tier[V] | None = None,
        swa_pool: SwaPoolTier[V] | None = None,
        global_pool: Tier[V] | None = None,
        device: TierCounters | None = None,
        prefix_caching: bool = True,
        supersede: bool = False,
        on_supersede: Callable[[Hashable, list[Hashable]], None] | None = None,
    ) -> None:
        self.policy, self.geometry, self.keys = policy, geometry, keys
        self.persistent, self.swa_pool, self.global_pool = persistent, swa_pool, global_pool
        self.device = device if device is not None else TierCounters()
        self.prefix_caching, self.supersede, self.on_supersede = prefix_caching, supersede, on_supersede
        p, s, g = (
            t.counters if t is not None else TierCounters() for t in (persistent, swa_pool, global_pool)
        )
        self.stats = CacheStats(self.device, p, s, g)

    # --- lookup ---

    def usable_blocks(self, prompt_tokens: int) -> int:
        """Prompt blocks a lookup may adopt: ``(N − 1) // B`` (the last token's logits are needed), 0 when
        prefix caching is off."""
        return (prompt_tokens - 1) // self.geometry.block_size if self.prefix_caching else 0

    def load(self, req: CacheRequest[V], first: int, end: int, accept: Callable[[int, V], bool]) -> Loaded:
        """Load blocks ``[first, end)`` of ``req`` from the lower tiers, in order: the run of them the global
        pool holds, then the run the persistent tier holds from there; each read `LOAD_BATCH` at a time.
        ``accept(i, payload)`` takes block ``i`` into the device pool and returns False when it cannot (pool
        full). Stops at the first miss, wrong-sized payload or refusal. Blocks from one tier are copied into
        the other: a global-pool hit into the persistent tier (this machine's durable copy), a persistent
        hit into the global pool (promoted, so other machines find it)."""
        if first >= end:
            return _NONE_LOADED  # nothing to look for (a hit from the device pool alone)
        refused = False

        def take(i: int, payload: V) -> bool:
            nonlocal refused
            refused = refused or not accept(i, payload)
            return not refused

        glob = self._load_from(self.global_pool, self.persistent, req, first, end, take)
        disk = (
            0 if refused else self._load_from(self.persistent, self.global_pool, req, first + glob, end, take)
        )
        return Loaded(glob, disk)

    def _load_from(
        self,
        tier: Tier[V] | None,
        copy_to: Tier[V] | None,
        req: CacheRequest[V],
        first: int,
        end: int,
        accept: Callable[[int, V], bool],
    ) -> int:
        """The run of blocks ``[first, end)`` ``tier`` holds, accepted until the first failure, each accepted
        block also put in ``copy_to``; returns how many were accepted."""
        if tier is None or first >= end:
            return 0
        keys = self.keys.keys(req.blocks[first:end], KeyKind.BLOCK)
        present = tier.contains_prefix(keys)
        done, taken = 0, []
        for s in range(0, present, LOAD_BATCH):
            batch = keys[s : min(s + LOAD_BATCH, present)]  # nothing past the run: no read, no LRU move
            tokens = req.tokens(first + s, first + s + len(batch))
            for j, payload in enumerate(tier.get_many(batch, tokens)):
                if payload is None or value_bytes(payload) != self.geometry.payload_bytes(first + done):
                    break
                if not accept(first + done, payload):
                    break
                taken.append((batch[j], None if tokens is None else tokens[j], payload))
                done += 1
            else:
                continue
            break
        if copy_to is not None and taken:
            copy_to.put_many(taken)
        return done

    def plan(
        self, req: CacheRequest[V], hit_blocks: int, *, use_stored: bool = True
    ) -> tuple[RestorePlan, RestoreWindow | Replay | None]:
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
        at = plan.snapshot_at
        if plan.snapshot_source is not None and at is not None:
            keys, payloads = found[at]
            return plan, RestoreWindow(at, plan.snapshot_source, keys, payloads)
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

    def corrupt(self, window: RestoreWindow) -> None:
        """Count a restored payload the executor found invalid (it then plans with ``use_stored=False``)."""
        tier = self.stats.swa_pool if window.source is WindowSource.SWA_POOL else self.stats.persistent
        tier.corrupt_dropped += 1

    def admit(
        self, req: CacheRequest[V], plan: RestorePlan, *, device_blocks: int, loaded: Loaded
    ) -> Provenance:
        """Adopt ``plan`` for ``req``, whose lookup took ``device_blocks`` blocks from the device pool and
        ``loaded`` from the lower tiers (`load`): count the lookup and the work, and return the request's
        `Provenance`."""
        g, s = self.geometry, self.stats
        n, bs = req.prompt_tokens, g.block_size
        usable, hit = self.usable_blocks(n), plan.hit_tokens
        req.plan, req.persisted = plan, hit // bs
        s.device.query_tokens += usable * bs
        s.device.hit_tokens += device_blocks * bs
        if self.global_pool is not None:
            s.global_pool.query_tokens += (usable - device_blocks) * bs
            s.global_pool.hit_tokens += loaded.global_pool * bs
        if self.persistent is not None:
            s.persistent.query_tokens += (usable - device_blocks - loaded.global_pool) * bs
            s.persistent.hit_tokens += loaded.persistent * bs
        if self.policy.store is WindowSource.SWA_POOL and hit:
            s.swa_pool.query_tokens += min(g.window, hit)
            if plan.snapshot_source is WindowSource.SWA_POOL:
                s.swa_pool.hit_tokens += min(g.window, hit)
        s.snapshot_restores += plan.snapshot_source is not None
        if plan.snapshot_source is WindowSource.SWA_POOL:
            req.pool_snapshots = [self.keys.key(req.blocks[hit // bs - 1], KeyKind.POOL_SNAPSHOT)]
        s.replayed_tokens += plan.replay_tokens
        s.computed_tokens += n - hit
        return Provenance.of(
            plan,
            prompt_tokens=n,
            device_tokens=device_blocks * bs,
            global_pool_tokens=loaded.global_pool * bs,
            window=g.window,
        )

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
        if tier is not None or self.global_pool is not None:
            ids = req.blocks[first:full]
            tokens = [None] * len(ids) if req.block_tokens is None else req.block_tokens[first:full]
            items = list(zip(self.keys.keys(ids, KeyKind.BLOCK), tokens, blocks(first, full), strict=True))
            if self.global_pool is not None:  # global KV only: window state stays in its own tiers
                self.global_pool.put_many(items)
        if tier is not None:
            if self.policy.store is WindowSource.WINDOW_BLOCKS:  # each block's window entries after it
                rows = list(map(window_block, range(first, full)))
                window = zip(self.keys.keys(ids, KeyKind.WINDOW_BLOCK), tokens, rows, strict=True)
                both: list[tuple[Hashable, Sequence[int] | None, V | None]]
                both = list(chain.from_iterable(zip(items, window, strict=True)))
                if None in rows:  # a block without window entries: its global KV only
                    both = [item for item in both if item[2] is not None]
                items = cast("list[tuple[Hashable, Sequence[int] | None, V]]", both)
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
        if older and self.supersede and self.swa_pool is not None:  # pooled: ``tier`` is the SWA pool
            self.swa_pool.discard_many(older)  # replaced, never held beside the newer one
        stored = tier.put_many([(key, tokens, value)])
        self.stats.snapshots_stored += stored
        if stored and pooled:
            if older and self.on_supersede is not None:
                self.on_supersede(key, older)
            req.pool_snapshots = [key]
