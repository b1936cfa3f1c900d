"""The engine's cache system of one model: executes the control plane's actions with tensors.

What a request goes through (DESIGN.md §2; the rules are `kvdiet.cache.control.ControlPlane`'s):
1. `ModelRunner.start`: hash the prompt's full blocks (chained, bound to the model fingerprint); take the
   longest prefix from the device pool (`BlockPool.lookup_and_take`), then load its continuation from the
   global pool, then the persistent tier, into fresh blocks (`ControlPlane.load`); the plan at the hit
   (`ControlPlane.plan`): restore the window state it read (a snapshot, or ``full-store``'s window blocks)
   or rewind the request and replay from the plan's start. The hit is capped below the prompt's last token,
   whose logits the request needs.
2. `ModelRunner.prefill` / `ModelRunner.decode`: blocks are reserved (`kvdiet.cache.reserve`), the model runs;
   each block that fills is published to the device prefix index, and `ControlPlane.after_forward` writes
   it through and captures window state where the policy keeps it (prefill chunks end at
   `ControlPlane.capture_points`).
3. `ModelRunner.finish` stores the window state held for the end and returns the blocks; `ModelRunner.abort` only
   returns the blocks. Both are idempotent.

The model reads and writes global KV in place in the device pool through each request's block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from kvdiet.cache.block_pool import BlockPool
from kvdiet.cache.control import CacheRequest, ControlPlane, Geometry
from kvdiet.cache.keys import HashKeys
from kvdiet.cache.options import CacheOptions
from kvdiet.cache.plan import Replay, RestoreWindow, WindowSource
from kvdiet.cache.prefix import ROOT_HASH, chain_hash, model_fingerprint
from kvdiet.cache.reserve import reserve_blocks
from kvdiet.device import to_host
from kvdiet.engine.session import Session
from kvdiet.engine.tiers import Tiers
from kvdiet.engine.window_blocks import WindowBlockLog, restore_window_blocks, window_block_bytes
from kvdiet.model.checksum import weights_checksum
from kvdiet.model.snapshot import SnapshotError, restore_snapshot, snapshot_bytes
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.setting_error import SettingError
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.storage.entry import StoreIdentity
from kvdiet.storage.swa_pool import SwaPool
from kvdiet.threads import AdaptiveThreads

__all__ = ["CacheOptions", "ModelRunner", "Session", "pool_num_blocks"]


def pool_num_blocks(options: CacheOptions, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` bytes that ``options.kv_cache_memory`` holds.

    Raises:
        SettingError (a ValueError): fewer than one, or a checkpoint period that is not a multiple of the block
            size (named as keywords; as flags in `SettingError.as_flags`).
    """
    k, bs = options.policy.checkpoint_every, options.block_size
    if k is not None and k % bs:
        raise SettingError(f"{{policy}}: checkpoint period {k} must be a multiple of the block size {bs}")
    num_blocks = options.kv_cache_memory // block_bytes
    if num_blocks < 1:
        raise SettingError(
            f"{{kv_cache_memory}} {options.kv_cache_memory} B is below one block ({block_bytes} B)"
        )
    return num_blocks


class ModelRunner:
    """The cache system of one model (see the module docstring).

    Args:
        model: the V4.1 model.
        options: sizes, TTLs, policy; a block size or policy left None is the model's (`CacheOptions.for_model`),
            and ``self.options`` holds the result.
        tokenizer_id: identity of the tokenizer (part of the fingerprint), e.g. a vocabulary checksum.
        swa_pool: an SWA-pool backend, opened and closed by its owner (default: the one ``options.swa_pool``
            names, with ``options``' size and TTL, namespaced by this model's fingerprint; this cache opens
            and closes it).
        clock: time source of the TTLs. threads: torch's CPU pool, checked before each forward (None: fixed).
    Raises:
        ValueError: a budget below one block, a block size that splits a compression group, a checkpoint
            period that is not a multiple of the block size, or a bad ``options.swa_pool`` or
            ``options.global_pool``.
    """

    def __init__(
        self,
        model: Transformer,
        options: CacheOptions | None = None,
        *,
        tokenizer_id: str = "none",
        swa_pool: SwaPool | None = None,
        clock: Clock | None = None,
        threads: AdaptiveThreads | None = None,
    ) -> None:
        v4_flash = not model.cfg.is_v41
        opts = (options or CacheOptions()).for_model(v4_flash=v4_flash)  # None: the model's default
        self.model, self.options = model, opts
        cfg, bs = model.cfg, opts.block_size
        self.align = model.plan.block_unit
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
        self.clock, self.threads = clock or SystemClock(), threads
        identity = StoreIdentity(self.fingerprint.hex(), self.formats, bs)
        self.tiers = Tiers.build(opts, identity, swa_pool=swa_pool, clock=self.clock)
        self.persistent, self.swa_pool = self.tiers.persistent, self.tiers.swa_pool
        self.global_pool = self.tiers.global_pool
        # V4-Flash has no decoder side (plan.decoder_start is None): nothing to narrow
        self.decoder_replay = (
            opts.decoder_replay and opts.policy.decoder_replay and model.plan.decoder_start is not None
        )
        geometry = Geometry(
            block_size=bs,
            window=cfg.sliding_window,
            num_layers=len(model.plan.layers),
            align=self.align,
            block_bytes=self.pool.block_bytes,
            window_block_bytes=window_block_bytes(model, bs),
        )
        # window snapshots taken with decoder-side replay hold approximate decoder windows: keyed apart, so
        # an exact run never restores one (nor the reverse); global KV is the same in both modes
        self.control: ControlPlane[bytes] = ControlPlane(
            opts.policy,
            geometry,
            HashKeys(b"-r" if self.decoder_replay else b""),
            persistent=self.persistent,
            swa_pool=self.swa_pool,
            global_pool=self.global_pool,
            device=self.pool.blocks.counters,
            prefix_caching=opts.prefix_caching,
        )
        self.stats = self.control.stats
        self._opened = False

    def unstored_window_warning(self) -> str | None:
        """Why prefix reuse is mostly lost, or None: the policy keeps window state in the persistent tier
        (``boundary-snapshot``, ``checkpoint:K``, ``full-store``), there is none, and prefix caching is on.
        Every hit then recomputes the ``W + (L−1)(W−1)`` tokens below it (`exact_recompute_start`), so no
        prefix of up to that many tokens is ever reused."""
        stored_there = self.options.policy.store in (WindowSource.PERSISTENT, WindowSource.WINDOW_BLOCKS)
        if not stored_there or self.persistent is not None or not self.options.prefix_caching:
            return None
        g = self.control.geometry
        span = g.window + (g.num_layers - 1) * (g.window - 1)
        return (
            f"--swa-policy {self.options.policy} keeps window state in the persistent tier, but there is none "
            f"(--persistent-dir none; CacheOptions(persistent_dir=None)): every prefix hit recomputes the "
            f"{span:,} tokens below it, so no prefix of up to {span:,} tokens is reused and longer ones save "
            f"only the tokens past that; give --persistent-dir DIR (CacheOptions(persistent_dir=DIR)) to reuse "
            f"prefixes"
        )

    # --- lifecycle of the tiers ---

    def open(self) -> ModelRunner:
        """Open the persistent tier, the global pool and the SWA pool this cache owns (a failure there only
        disables the tier or makes it miss, with one warning); idempotent."""
        if not self._opened:
            self.tiers.open()
            self._opened = True
        return self

    def close(self) -> None:
        self.tiers.close()
        self._opened = False

    def __enter__(self) -> ModelRunner:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def window(self) -> int:
        return self.model.cfg.sliding_window

    # --- request start: lookup, load, restore or replay ---

    def start(self, prompt_ids: Sequence[int]) -> Session:
        """Look the prompt up and prepare its request state (see the module docstring).

        ``prompt_ids`` were checked at the edge (`kvdiet.engine.prepared`: non-empty, in the vocabulary,
        within the context) and are not checked again here. Returns a `Session` whose ``state.num_tokens``
        is the first position still to prefill. A full device pool only shortens what is loaded from the
        persistent tier; a stored window state that fails validation is a miss (counted as corrupt) and the
        plan falls back as if it were absent.
        """
        ids = [int(t) for t in prompt_ids]
        n, bs, control = len(ids), self.options.block_size, self.control
        blocks = [ids[s : s + bs] for s in range(0, n - bs + 1, bs)]
        hashes = self._hashes(ROOT_HASH, blocks)
        req: CacheRequest[bytes] = CacheRequest(n, list(hashes), list(blocks))
        usable = control.usable_blocks(n)
        taken = self.pool.blocks.lookup_and_take(hashes[:usable], blocks[:usable])
        device = len(taken)

        def accept(i: int, payload: bytes) -> bool:
            if self.pool.blocks.num_free == 0:
                return False
            (b,) = self.pool.allocate(1)
            self.pool.write_block(b, payload)
            self.pool.blocks.publish(b, hashes[i], blocks[i])
            taken.append(b)
            return True

        loaded = control.load(req, device, usable, accept)
        plan, window = control.plan(req, len(taken))
        state = self._state(taken, plan.hit_tokens)
        if isinstance(window, RestoreWindow):
            try:
                self._restore(state, window, ids)
            except SnapshotError:
                control.corrupt(window)
                plan, window = control.plan(req, len(taken), use_stored=False)
                if plan.hit_tokens == 0:
                    state.table.release()
                    state = self.model.new_state(self.pool)
        if isinstance(window, Replay):
            self.model.rewind(state, window.start, ids)
        prov = control.admit(req, plan, device_blocks=device, loaded=loaded)
        adopted = plan.hit_tokens // bs
        del req.blocks[adopted:], req.block_tokens[adopted:]  # later blocks are hashed as they fill
        log = WindowBlockLog(bs, adopted) if self._logs_window_blocks() else None
        return Session(state, ids, n, prov, req, log)

    def _state(self, taken: list[int], hit_tokens: int) -> RequestState:
        """A request state on the blocks taken; none of them when the plan adopts nothing."""
        if hit_tokens == 0 and taken:
            self.pool.blocks.release(taken)
            taken = []
        return self.model.new_state(self.pool, blocks=taken, num_tokens=hit_tokens)

    def _restore(self, state: RequestState, window: RestoreWindow, ids: list[int]) -> None:
        """Load the window state a plan restores. Raises `SnapshotError` on a payload that fails validation."""
        if window.source is WindowSource.WINDOW_BLOCKS:
            data = b"".join(window.payloads)
            restore_window_blocks(self.model, state, window.at, data, ids, self.options.block_size)
        else:
            restore_snapshot(state, window.payloads[0], self.fingerprint)

    def _logs_window_blocks(self) -> bool:
        store = self.persistent  # not bool(store): an empty store has len 0
        return self.options.policy.store is WindowSource.WINDOW_BLOCKS and store is not None and store.enabled

    def admission_blocks(self, prompt_ids: Sequence[int], extra_tokens: int) -> int:
        """Free device blocks `start` + `prefill` of ``prompt_ids`` plus ``extra_tokens`` decode tokens would consume:
        all the blocks the tokens span, except leading prefix blocks other requests hold now (shared). Blocks cached
        but unreferenced count as consumed (they leave the free queue); so do global-pool and persistent hits
        (loaded into fresh blocks). Changes nothing; counts nothing."""
        n, bs = len(prompt_ids), self.options.block_size
        total = -(-(n + extra_tokens) // bs)
        usable = self.control.usable_blocks(n)
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
        stops = self.control.capture_points(session.prompt_tokens)
        logits = None
        while state.num_tokens < n:
            start = state.num_tokens
            end = min(n, start + chunk_size, *(p for p in stops if p > start))
            reserve_blocks([(state.table, end)])  # the model computes; the cache allocates
            if self.threads is not None:  # fewer threads while other work takes the cores
                self.threads.check()
            self._start_log(session)
            try:
                logits = self.model.prefill(
                    state, session.tokens[start:end], decoder_replay=self.decoder_replay
                )
            finally:
                self._stop_log(session)
            self._after_forward(session, start)
            if progress is not None:
                progress.advance(end - start)
        return None if logits is None else to_host(logits)  # sampled on the host: logits cross here

    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
        """Feed one sampled token to each session; returns fp32 [B, V].

        Raises:
            NoFreeBlocksError: the pool cannot hold one more token of every session (nothing allocated).
        """
        reserve_blocks([(s.state.table, s.state.num_tokens + 1) for s in sessions])
        starts = [s.state.num_tokens for s in sessions]
        if self.threads is not None:
            self.threads.check()
        for s in sessions:
            self._start_log(s)
        try:
            logits = self.model.decode([s.state for s in sessions], tokens)
        finally:
            for s in sessions:
                self._stop_log(s)
        for s, t, start in zip(sessions, tokens, starts, strict=True):
            s.tokens.append(int(t))
            self._after_forward(s, start)
        return to_host(logits)  # sampled on the host: the batch's logits cross here, once

    @staticmethod
    def _start_log(session: Session) -> None:
        if session.window_log is not None:
            session.window_log.start(session.state)

    @staticmethod
    def _stop_log(session: Session) -> None:
        if session.window_log is not None:
            session.window_log.stop(session.state)

    def _after_forward(self, session: Session, start: int) -> None:
        """Publish the blocks that filled, then let the control plane write through and capture."""
        state, req, bs = session.state, session.cache, self.options.block_size
        end = state.num_tokens
        full = end // bs
        if full > len(req.blocks):
            first = len(req.blocks)
            blocks = [session.tokens[i * bs : (i + 1) * bs] for i in range(first, full)]
            hashes = self._hashes(req.blocks[-1] if req.blocks else ROOT_HASH, blocks)
            req.blocks += hashes
            req.block_tokens += blocks
            for i in range(first, full):
                self.pool.blocks.publish(state.table.ids[i], req.blocks[i], req.block_tokens[i])
        log = session.window_log

        def snapshot(pos: int) -> bytes:
            assert pos == end, "prefill chunks end at every capture point"
            return snapshot_bytes(state, self.fingerprint)

        self.control.after_forward(
            req,
            start,
            end,
            blocks=lambda i, j: [self.pool.read_block(b) for b in state.table.ids[i:j]],
            window_block=lambda i: log.pop(i) if log is not None else None,
            snapshot=snapshot,
        )

    # --- end of a request ---

    def finish(self, session: Session) -> None:
        """Store the window state held for the end, return the blocks; again (or after `abort`): nothing."""
        if session.done:
            return
        self.control.finish(session.cache)
        self.abort(session)

    def abort(self, session: Session) -> None:
        """Return the session's blocks to the pool (published ones stay findable); idempotent (case B24)."""
        if session.done:
            return
        session.done = True
        session.state.table.release()
