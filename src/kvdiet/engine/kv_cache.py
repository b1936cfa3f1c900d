"""The KV-cache system of one model: device pool, prefix cache, persistent tier, SWA pool, replay, policies.

What a request goes through (DESIGN.md §2):
1. `KVCache.start`: hash the prompt's full blocks (chained, bound to the model fingerprint); take the
   longest prefix from the device pool, then continue it from the persistent tier (blocks loaded back into
   the pool); plan the window state at the hit boundary H with the SWA policy (`SwaPolicy.plan`): restore a
   snapshot, or rewind the request and recompute from the plan's replay start. The hit is capped below the
   prompt's last token, whose logits the request needs.
2. `KVCache.prefill` / `KVCache.decode`: run the model; each block that fills is published to the
   device prefix index and written through to the persistent tier; window state is captured at the
   positions the policy keeps (the prompt's last block boundary, the last boundary reached, every K tokens,
   or every token's window entries for ``full-store``).
3. `KVCache.finish` stores the captured window state (SWA pool or persistent tier) and returns the blocks;
   `KVCache.abort` only returns the blocks. Both are idempotent.

The model reads and writes global KV in place in the device pool through each request's block table.
This module knows the model only through `Transformer`'s public methods.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvdiet.cache.block_pool import BlockPool
from kvdiet.cache.counters import TierCounters
from kvdiet.cache.manager import KeyKind, RestorePlan, WindowSource
from kvdiet.cache.options import CacheOptions
from kvdiet.cache.policy import Capture
from kvdiet.cache.prefix import ROOT_HASH, chain_hash, model_fingerprint
from kvdiet.cache.reserve import reserve_blocks
from kvdiet.model.snapshot import SnapshotError, restore_snapshot, snapshot_bytes
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.storage.persistent import PersistentStore, StoreIdentity
from kvdiet.storage.swa_pool import SwaPool
from kvdiet.storage.swa_pool_factory import create_swa_pool

__all__ = [
    "CacheOptions",
    "CacheStats",
    "KVCache",
    "Provenance",
    "Session",
    "pool_num_blocks",
    "weights_checksum",
]

_LOAD_BATCH = 32
"""Blocks read from the persistent tier per batch (one index transaction each)."""


@dataclass(slots=True)
class CacheStats:
    """Counters of the whole system: one `TierCounters` per tier plus replay work (tokens)."""

    device: TierCounters
    persistent: TierCounters
    swa_pool: TierCounters
    replayed_tokens: int = 0
    computed_tokens: int = 0
    snapshot_restores: int = 0
    snapshots_stored: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device.as_dict(),
            "persistent": self.persistent.as_dict(),
            "swa_pool": self.swa_pool.as_dict(),
            "replayed_tokens": self.replayed_tokens,
            "computed_tokens": self.computed_tokens,
            "snapshot_restores": self.snapshot_restores,
            "snapshots_stored": self.snapshots_stored,
        }


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a prompt's tokens came from.

    Attributes:
        prompt_tokens: N.
        device_tokens / persistent_tokens: global KV taken from the device pool / loaded from the persistent
            tier (tokens; block multiples; together the hit H).
        window_source: ``"swa-pool"``, ``"persistent"`` (a stored snapshot), ``"window-blocks"``
            (full-store), ``"replay"`` (bounded or exact recompute) or ``"none"`` (cold).
        window_tokens: tokens whose window state was restored from ``window_source`` (0 for replay/cold).
        replayed_tokens: tokens recomputed below H to rebuild window state (global KV not rewritten).
        computed_tokens: tokens ``[H, N)`` prefilled as usual.
        exact: whether the continuation equals a cold run (False for a bounded replay).
    """

    prompt_tokens: int
    device_tokens: int
    persistent_tokens: int
    window_source: WindowSource
    window_tokens: int
    replayed_tokens: int
    computed_tokens: int
    exact: bool

    @property
    def hit_tokens(self) -> int:
        return self.device_tokens + self.persistent_tokens

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"hit_tokens": self.hit_tokens}


@dataclass(slots=True)
class Session:
    """One request inside the cache system (created by `KVCache.start`)."""

    state: RequestState
    tokens: list[int]
    prompt_tokens: int
    provenance: Provenance
    plan: RestorePlan
    hashes: list[bytes]
    persisted: int  # leading blocks known to be in the persistent tier
    captures: dict[int, bytes] = field(default_factory=dict)  # position → window snapshot, stored at finish
    window_blocks: dict[int, bytes] = field(default_factory=dict)  # full-store: block index → [L, bs, width]
    window_pending: tuple[torch.Tensor, torch.Tensor] | None = None  # full-store rows of a partial block
    done: bool = False


def pool_num_blocks(options: CacheOptions, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` bytes that ``options.kv_cache_memory`` holds.

    Raises:
        ValueError: fewer than one, or a checkpoint period that is not a multiple of the block size.
    """
    k, bs = options.policy.checkpoint_every, options.block_size
    if k is not None and k % bs:
        raise ValueError(f"checkpoint period {k} must be a multiple of the block size {bs}")
    num_blocks = options.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"--kv-cache-memory {options.kv_cache_memory} B is below one block ({block_bytes} B)"
        )
    return num_blocks


def weights_checksum(model: torch.nn.Module) -> str:
    """SHA-256 hex of every parameter's name, shape, dtype and bytes (part of the model fingerprint).

    Tensors not in memory (routed experts and Engram tables a checkpoint serves on first use) count by their
    name and shape, and the model's ``weights_digest`` (the checkpoint's headers, sizes and times) stands
    for their bytes.
    """
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if p.device.type != "meta":
            h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(str(getattr(model, "weights_digest", "")).encode())
    return h.hexdigest()


def _derived_key(block_hash: bytes, kind: KeyKind, tag: bytes = b"") -> bytes:
    """The tier key of ``kind`` at a block (``tag``: the decoder-replay mark of window snapshots)."""
    return hashlib.blake2b(block_hash, digest_size=32, person=b"kvdiet-" + kind.encode() + tag).digest()


class KVCache:
    """The cache system of one model (see the module docstring).

    Args:
        model: the V4.1 model.
        options: sizes, TTLs, policy.
        tokenizer_id: identity of the tokenizer (part of the fingerprint), e.g. a vocabulary checksum.
        swa_pool: an SWA-pool backend, opened and closed by its owner (default: the one ``options.swa_pool``
            names, with ``options``' size and TTL, namespaced by this model's fingerprint; this cache opens
            and closes it).
        clock: time source of the TTLs.
    Raises:
        ValueError: a budget below one block, a block size that splits a compression group, a checkpoint
            period that is not a multiple of the block size, or a bad ``options.swa_pool``.
    """

    def __init__(
        self,
        model: Transformer,
        options: CacheOptions | None = None,
        *,
        tokenizer_id: str = "none",
        swa_pool: SwaPool | None = None,
        clock: Clock | None = None,
    ) -> None:
        opts = options or CacheOptions()
        self.model, self.options = model, opts
        cfg, bs = model.cfg, opts.block_size
        ratios = [model.plan[s].compress_ratio for s in model.plan.kv_sources]
        self.align = math.lcm(*ratios)
        num_blocks = pool_num_blocks(opts, model.new_pool(1, block_size=bs).block_bytes)
        self.pool = model.new_pool(num_blocks, block_size=bs, blocks=BlockPool(num_blocks, bs))
        self.formats = (model.codecs.main.name, model.codecs.index_key.name, model.codecs.window.name)
        self.fingerprint = model_fingerprint(
            {
                "config": asdict(cfg),
                "weights": weights_checksum(model),
                "tokenizer": tokenizer_id,
                "formats": self.formats,
                "block_size": bs,
            }
        )
        self.clock = clock or SystemClock()
        self.persistent = (
            PersistentStore(
                opts.persistent_dir,
                StoreIdentity(self.fingerprint.hex(), self.formats, bs),
                ttl_s=opts.persistent_ttl_s,
                capacity_bytes=opts.persistent_size,
                clock=self.clock,
            )
            if opts.persistent_dir is not None
            else None
        )
        self._owns_swa_pool = swa_pool is None  # a pool handed in (shared, Redis) outlives this cache
        self.swa_pool = (
            swa_pool
            if swa_pool is not None
            else create_swa_pool(
                opts.swa_pool,
                namespace=self.fingerprint.hex(),
                capacity_bytes=opts.swa_pool_size,
                ttl_s=opts.swa_pool_ttl_s,
                clock=self.clock,
            )
        )
        self.stats = CacheStats(
            self.pool.blocks.counters,
            self.persistent.counters if self.persistent is not None else TierCounters(),
            self.swa_pool.counters,
        )
        self.decoder_replay = opts.decoder_replay and opts.policy.decoder_replay
        # window snapshots taken with decoder-side bounded replay hold approximate decoder windows: keyed
        # apart, so an exact run never restores one (nor the reverse); global KV is the same in both modes
        self._window_tag = b"-r" if self.decoder_replay else b""
        self._opened = False

    # --- lifecycle of the tiers ---

    def open(self) -> KVCache:
        """Open the persistent tier and the SWA pool this cache owns (a failure there only disables the tier
        or makes the pool miss, with one warning); idempotent."""
        if self._opened:
            return self
        if self.persistent is not None:
            self.persistent.open()
            self.persistent.sweep()  # expired entries leave now (and count), not at their next lookup
        if self._owns_swa_pool:
            self.swa_pool.open()
        self._opened = True
        return self

    def close(self) -> None:
        if self.persistent is not None:
            self.persistent.close()
        self._opened = False
        if self._owns_swa_pool:
            self.swa_pool.close()

    def __enter__(self) -> KVCache:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def window(self) -> int:
        return self.model.cfg.sliding_window

    def _persistent_on(self) -> bool:
        return self.persistent is not None and self.persistent.enabled

    # --- request start: lookup, load, restore or replay ---

    def start(self, prompt_ids: Sequence[int]) -> Session:
        """Look the prompt up and prepare its request state (see the module docstring).

        Returns a `Session` whose ``state.num_tokens`` is the first position still to prefill.
        Raises:
            ValueError: empty prompt, an id outside the vocabulary, longer than the context (before any
                lookup or state change).
        A full device pool only shortens what is loaded from the persistent tier; a stored window state
        that fails validation is a miss (counted as corrupt) and the plan falls back as if it were absent.
        """
        ids = self.model.check_tokens(prompt_ids).tolist()
        n, bs, w = len(ids), self.options.block_size, self.window
        blocks = [ids[s : s + bs] for s in range(0, n - bs + 1, bs)]
        hashes = self._hashes(ROOT_HASH, blocks)
        usable = (n - 1) // bs if self.options.prefix_caching else 0  # keep the last token to compute
        device = self.pool.blocks.lookup_and_take(hashes[:usable], blocks[:usable])
        loaded = self._load_persistent(hashes[len(device) : usable], blocks[len(device) : usable])
        taken = device + loaded
        hit = len(taken) * bs
        c = self.stats
        c.device.query_tokens += usable * bs
        c.device.hit_tokens += len(device) * bs
        if self.persistent is not None:
            c.persistent.query_tokens += (usable - len(device)) * bs
            c.persistent.hit_tokens += len(loaded) * bs

        fetched: dict[int, bytes] = {}
        plan = self._plan(hit, hashes, blocks, fetched)
        state = self.model.new_state(self.pool, blocks=taken, num_tokens=hit)
        if plan.hit_tokens == 0 and hit:
            state.table.release()
            state = self.model.new_state(self.pool)
        if plan.snapshot_source is not None:
            try:
                self._restore(state, plan, fetched[plan.snapshot_at], ids)
                c.snapshot_restores += 1
            except SnapshotError:
                tier = c.swa_pool if plan.snapshot_source is WindowSource.SWA_POOL else c.persistent
                tier.corrupt_dropped += 1
                plan = self._plan(hit, hashes, blocks, {}, allow_snapshots=False)
                if plan.hit_tokens == 0:
                    state.table.release()
                    state = self.model.new_state(self.pool)
        if plan.snapshot_source is None and plan.hit_tokens:
            self.model.rewind(state, plan.replay_start, ids)
        if plan.snapshot_source is WindowSource.SWA_POOL:
            c.swa_pool.hit_tokens += min(w, hit)
        if self.options.policy.store is WindowSource.SWA_POOL and hit:
            c.swa_pool.query_tokens += min(w, hit)
        c.replayed_tokens += plan.replay_tokens
        c.computed_tokens += n - plan.hit_tokens
        adopted = plan.hit_tokens // bs
        prov = Provenance(
            prompt_tokens=n,
            device_tokens=min(len(device), adopted) * bs,
            persistent_tokens=max(0, adopted - len(device)) * bs,
            window_source=plan.snapshot_source
            or (WindowSource.REPLAY if plan.hit_tokens else WindowSource.NONE),
            window_tokens=min(w, plan.snapshot_at or 0) if plan.snapshot_source else 0,
            replayed_tokens=plan.replay_tokens,
            computed_tokens=n - plan.hit_tokens,
            exact=not plan.clipped,
        )
        return Session(state, ids, n, prov, plan, hashes[:adopted], persisted=adopted)

    def admission_blocks(self, prompt_ids: Sequence[int], extra_tokens: int = 1) -> int:
        """Free device blocks `start` + `prefill` of ``prompt_ids`` plus ``extra_tokens`` decode tokens would
        consume: all the blocks the tokens span, except leading prefix blocks other requests hold now
        (shared, not consumed). Blocks cached but unreferenced count as consumed (they leave the free
        queue); so do persistent hits (loaded into fresh blocks). Changes nothing; counts nothing."""
        n, bs = len(prompt_ids), self.options.block_size
        total = -(-(n + extra_tokens) // bs)
        usable = (n - 1) // bs if self.options.prefix_caching else 0
        if usable == 0:
            return total
        blocks = [list(prompt_ids[s : s + bs]) for s in range(0, usable * bs, bs)]
        matched = self.pool.blocks.match(self._hashes(ROOT_HASH, blocks), blocks)
        return total - sum(1 for b in matched if self.pool.blocks.ref_count(b) > 0)

    def _hashes(self, parent: bytes, blocks: Sequence[Sequence[int]]) -> list[bytes]:
        out = []
        for block in blocks:
            parent = chain_hash(parent, block, self.fingerprint, self.options.cache_salt)
            out.append(parent)
        return out

    def _load_persistent(self, hashes: list[bytes], blocks: list[list[int]]) -> list[int]:
        """Load the longest run of ``hashes`` from the persistent tier into fresh device blocks."""
        if not hashes or not self._persistent_on():
            return []
        present = self.persistent.contains_prefix(hashes)  # index only: how far to read
        out: list[int] = []
        for s in range(0, present, _LOAD_BATCH):  # batches, so a broken chain stops the reads early
            keys, toks = hashes[s : s + _LOAD_BATCH], blocks[s : s + _LOAD_BATCH]
            for h, tokens, payload in zip(keys, toks, self.persistent.get_many(keys, toks), strict=True):
                if payload is None or len(payload) != self.pool.block_bytes or self.pool.blocks.num_free == 0:
                    return out
                (b,) = self.pool.allocate(1)
                self.pool.write_block(b, payload)
                self.pool.blocks.publish(b, h, tokens)
                out.append(b)
        return out

    def _plan(
        self,
        hit: int,
        hashes: list[bytes],
        blocks: list[list[int]],
        fetched: dict[int, bytes],
        *,
        allow_snapshots: bool = True,
    ) -> RestorePlan:
        policy, bs = self.options.policy, self.options.block_size

        def has_snapshot(pos: int) -> bool:
            if not allow_snapshots or pos % bs or pos <= 0:
                return False
            i = pos // bs - 1
            if policy.store is WindowSource.SWA_POOL:
                data = self.swa_pool.get(_derived_key(hashes[i], KeyKind.POOL_SNAPSHOT, self._window_tag))
            elif policy.store is WindowSource.WINDOW_BLOCKS:
                data = self._read_window_blocks(pos, hashes, blocks)
            elif self._persistent_on():
                data = self.persistent.get(
                    _derived_key(hashes[i], KeyKind.SNAPSHOT, self._window_tag), blocks[i]
                )
            else:
                data = None
            if data is not None:
                fetched[pos] = data
            return data is not None

        return policy.plan(
            hit,
            window=self.window,
            num_layers=len(self.model.plan.layers),
            align=self.align,
            has_snapshot=has_snapshot,
        )

    def _restore(self, state: RequestState, plan: RestorePlan, data: bytes, ids: list[int]) -> None:
        if plan.snapshot_source is WindowSource.WINDOW_BLOCKS:
            self._restore_window_blocks(state, plan.snapshot_at, data, ids)
        else:
            restore_snapshot(state, data, self.fingerprint)

    # --- full-store: every token's window entries, one payload per block ---

    def _window_block_bytes(self) -> int:
        c = self.model.codecs.window
        return len(self.model.plan.layers) * self.options.block_size * c.width * c.dtype.itemsize

    def _read_window_blocks(self, pos: int, hashes: list[bytes], blocks: list[list[int]]) -> bytes | None:
        if not self._persistent_on():
            return None
        bs = self.options.block_size
        first = max(0, pos - self.window) // bs
        parts = []
        for i in range(first, pos // bs):
            data = self.persistent.get(_derived_key(hashes[i], KeyKind.WINDOW_BLOCK), blocks[i])
            if data is None or len(data) != self._window_block_bytes():
                return None
            parts.append(data)
        return b"".join(parts)

    def _restore_window_blocks(self, state: RequestState, pos: int, data: bytes, ids: list[int]) -> None:
        bs, w = self.options.block_size, self.window
        first = max(0, pos - w) // bs * bs
        layers = len(state.windows)
        ring = state.windows[0]
        rows = torch.frombuffer(bytearray(data), dtype=ring.rows.dtype).view(
            -1, layers, bs, ring.rows.shape[1]
        )
        rows = rows.permute(1, 0, 2, 3).reshape(layers, -1, ring.rows.shape[1])  # [L, tokens, width]
        positions = torch.arange(first, pos)
        keep = positions >= pos - w
        self.model.rewind(state, pos, ids)  # empties rings and tails, history at pos
        for layer, r in enumerate(state.windows):
            slots = positions[keep] % w
            r.rows[slots] = rows[layer][keep]
            r.positions[slots] = positions[keep]

    # --- running the model ---

    def prefill(
        self,
        session: Session,
        *,
        chunk_size: int = 512,
        max_tokens: int | None = None,
        progress: object | None = None,
    ) -> torch.Tensor:
        """Prefill the session's remaining prompt tokens in chunks; returns the last row's logits fp32 [V]
        (the next-token logits once the whole prompt is in).

        Chunks also end where the policy captures window state. ``max_tokens`` (optional) stops after that
        many tokens (a scheduler's chunk). ``progress`` (optional) gets ``advance(tokens)`` calls.
        Raises:
            ValueError: chunk_size or max_tokens < 1, or nothing left to prefill.
            NoFreeBlocksError: the pool is full (the session keeps what it has).
        """
        if chunk_size < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"chunk_size and max_tokens must be >= 1, got {chunk_size}, {max_tokens}")
        state = session.state
        if state.num_tokens >= session.prompt_tokens:
            raise ValueError(f"the session's {session.prompt_tokens} prompt tokens are all prefilled")
        n = (
            session.prompt_tokens
            if max_tokens is None
            else min(session.prompt_tokens, state.num_tokens + max_tokens)
        )
        stops = self._capture_points(session)
        logits = None
        while state.num_tokens < n:
            start = state.num_tokens
            end = min(n, start + chunk_size, *(p for p in stops if p > start))
            reserve_blocks([(state.table, end)])  # the model computes; the cache allocates
            log = self._log_windows(session)
            try:
                logits = self.model.prefill(
                    state, session.tokens[start:end], bounded_replay=self.decoder_replay
                )
            finally:
                self._stop_logging(session)
            self._after_forward(session, log)
            if progress is not None:
                progress.advance(end - start)
        return logits

    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
        """Feed one sampled token to each session; returns fp32 [B, V].

        Raises:
            NoFreeBlocksError: the pool cannot hold one more token of every session (nothing allocated).
        """
        reserve_blocks([(s.state.table, s.state.num_tokens + 1) for s in sessions])
        logs = [self._log_windows(s) for s in sessions]
        try:
            logits = self.model.decode([s.state for s in sessions], tokens)
        finally:
            for s in sessions:
                self._stop_logging(s)
        for s, t, log in zip(sessions, tokens, logs, strict=True):
            s.tokens.append(int(t))
            self._after_forward(s, log)
        return logits

    def _capture_points(self, session: Session) -> list[int]:
        bs, n = self.options.block_size, session.prompt_tokens
        policy = self.options.policy
        points = {(n - 1) // bs * bs, n // bs * bs} - {0}
        points |= set(policy.checkpoints(n))
        return sorted(points)

    def _log_windows(self, session: Session) -> list | None:
        if self.options.policy.store is not WindowSource.WINDOW_BLOCKS or not self._persistent_on():
            return None
        log: list = []
        for ring in session.state.windows:
            ring.log = log
        return log

    @staticmethod
    def _stop_logging(session: Session) -> None:
        for ring in session.state.windows:
            ring.log = None

    def _after_forward(self, session: Session, log: list | None) -> None:
        state, bs = session.state, self.options.block_size
        if log is not None:
            self._collect_windows(session, log)
        pos = state.num_tokens
        full = pos // bs
        if full > len(session.hashes):
            parent = session.hashes[-1] if session.hashes else ROOT_HASH
            blocks = [session.tokens[i * bs : (i + 1) * bs] for i in range(len(session.hashes), full)]
            session.hashes += self._hashes(parent, blocks)
            for i in range(full - len(blocks), full):
                self.pool.blocks.publish(
                    state.table.ids[i], session.hashes[i], session.tokens[i * bs : (i + 1) * bs]
                )
            self._write_through(session, full)
        plan = session.plan
        if (
            pos % bs == 0
            and pos > 0
            and pos >= plan.hit_tokens
            and not (plan.clipped and pos == plan.hit_tokens)
        ):
            self._capture(session, pos)  # a bounded replay's state at H is approximate: never stored

    def _write_through(self, session: Session, full: int) -> None:
        if not self._persistent_on():
            return
        bs, items = self.options.block_size, []
        for i in range(session.persisted, full):
            tokens = session.tokens[i * bs : (i + 1) * bs]
            items.append((session.hashes[i], tokens, self.pool.read_block(session.state.table.ids[i])))
            rows = session.window_blocks.pop(i, None)
            if rows is not None:
                items.append((_derived_key(session.hashes[i], KeyKind.WINDOW_BLOCK), tokens, rows))
        if items:
            self.persistent.put_many(items)
        session.persisted = full

    def _collect_windows(self, session: Session, log: list) -> None:
        """full-store: gather this forward's window rows of every layer; cut them into whole blocks."""
        bs = self.options.block_size
        if not log:
            return
        rows = torch.stack([r for r, _ in log])  # [L, T, width]: one write per layer
        pos = log[0][1]
        if session.window_pending is not None:
            rows, pos = (
                torch.cat([session.window_pending[0], rows], 1),
                torch.cat([session.window_pending[1], pos]),
            )
        done = int(pos[-1] + 1) // bs
        for i in range(max(int(pos[0]) // bs, session.persisted), done):
            sel = (pos >= i * bs) & (pos < (i + 1) * bs)
            if int(sel.sum()) == bs:
                session.window_blocks[i] = rows[:, sel].contiguous().view(torch.uint8).numpy().tobytes()
        keep = pos >= done * bs
        session.window_pending = (rows[:, keep], pos[keep]) if bool(keep.any()) else None

    def _capture(self, session: Session, pos: int) -> None:
        bs = self.options.block_size
        capture = self.options.policy.capture_at(pos, prompt_boundary=(session.prompt_tokens - 1) // bs * bs)
        if capture is None:
            return
        data = snapshot_bytes(session.state, self.fingerprint)
        if capture is Capture.NOW:
            self._store_snapshot(session, pos, data)
        else:
            session.captures = {pos: data}  # the latest boundary past the prompt's; stored at finish

    def _store_snapshot(self, session: Session, pos: int, data: bytes) -> None:
        i, bs = pos // self.options.block_size - 1, self.options.block_size
        if self.options.policy.store is WindowSource.SWA_POOL:
            ok = self.swa_pool.put(
                _derived_key(session.hashes[i], KeyKind.POOL_SNAPSHOT, self._window_tag), data
            )
        elif self._persistent_on():
            ok = self.persistent.put(
                _derived_key(session.hashes[i], KeyKind.SNAPSHOT, self._window_tag),
                session.tokens[i * bs : (i + 1) * bs],
                data,
            )
        else:
            ok = False
        self.stats.snapshots_stored += int(ok)

    # --- end of a request ---

    def finish(self, session: Session) -> None:
        """Store the captured window state (full blocks were written through as they filled) and return the
        blocks. A second call (or a call after `abort`) does nothing."""
        if session.done:
            return
        for pos, data in session.captures.items():
            self._store_snapshot(session, pos, data)
        session.captures.clear()
        self.abort(session)

    def abort(self, session: Session) -> None:
        """Return the session's blocks to the pool (published ones stay findable); idempotent (case B24)."""
        if session.done:
            return
        session.done = True
        session.state.table.release()
