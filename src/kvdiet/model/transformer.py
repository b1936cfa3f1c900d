"""The V4.1 text model with real packed caches: embedding, mHC blocks, final norm and LM head.

Driven only by `ModelConfig` and its `LayerPlan`. Block l (v41-spec §8.1a): Engram (if any) on the
streams, attention on ``attn_norm(collapse(h, previous FFN pre))``, expand; FFN (MoE) on
``ffn_norm(collapse(h, this attention's pre))``, expand. After the last block: collapse with the last FFN
pre, final norm, LM head in fp32.

Paths:
- `Transformer.prefill`: any chunk of consecutive tokens of one request (chunks may split a ratio-2 pair).
  With ``decoder_replay`` (default, as vLLM/SGLang/ATOM) the decoder layers (from the last KV source on)
  run only on the chunk's last ``sliding_window`` rows, whose windows read nothing older than
  ``chunk end − window``; every row still goes through the encoder and the last KV source's compressor and
  indexer keys, so the global KV is exactly that of a full prefill (v41-spec §6, §7.1).
- `Transformer.decode`: one token for each of several requests of any lengths.
- `kvdiet.model.reference.forward_full`: the slow no-cache reference these are tested against.
Bad input raises ``ValueError`` before any state changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.device import device_scope
from kvdiet.formats.codec import CacheCodecs
from kvdiet.layer_plan import DEFAULT_BLOCK_SIZE, LayerPlan
from kvdiet.model.attention import Segment, Selection
from kvdiet.model.block import Block
from kvdiet.model.block_ids import BlockAllocator
from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.decode_layer import decode_layer, prepare_step
from kvdiet.model.decode_step import DecodePlan
from kvdiet.model.engram_hash import EngramHasher
from kvdiet.model.hc import hc_collapse, hc_expand, hc_init_streams, hc_initial_pre
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear
from kvdiet.model.memory import check_fits, random_weights_bytes
from kvdiet.model.paged_pool import DevicePool
from kvdiet.model.state import BlockTable, PagedEntries, RequestState, WindowRings
from kvdiet.model.token_ids import check_token_ids, decode_token_ids

__all__ = ["Transformer"]

_INIT_STD = 0.02


class Transformer(nn.Module):
    """DeepSeek-V4.1 text model (vision and DSpark out of scope).

    Args:
        cfg: a V4.1 `ModelConfig`.
        exact: store caches unquantised in fp32 (for exactness tests) instead of packed bytes.
        token_map: Engram compressed-token map (int64 [vocab]); None → identity (valid only when
            ``engram_compressed_vocab_size == vocab_size``).
        meta: build every parameter and buffer on the meta device (no memory, no initialisation), for
            `kvdiet.model.loader` to fill from a checkpoint.
    Raises:
        ValueError: a V4 (non-V4.1) config; Engram or a compressor after the decoder start (bounded replay
            would then change global state).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        exact: bool = False,
        token_map: torch.Tensor | None = None,
        meta: bool = False,
    ) -> None:
        super().__init__()
        if not cfg.is_v41:
            raise ValueError(f"config {cfg.name!r} is {cfg.model_type}; the model implements V4.1 only")
        self.cfg, self.exact = cfg, exact
        self.weights_digest = ""  # set by the loader: identity of weights not held in memory
        self.load_report = None  # set by kvdiet.model.build.load_model: the loader's LoadReport
        self.plan = LayerPlan.from_config(cfg)
        self.codecs = CacheCodecs.for_dims(cfg.head_dim, cfg.index_head_dim, exact=exact)
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        start = self.plan.decoder_start
        late = [i for i in (cfg.engram_layer_ids or ()) if start is not None and i >= start]
        late += [i for i in self.plan.kv_sources if start is not None and i > start]
        if late:
            raise ValueError(f"layers {late} hold Engram or a compressor at/after the decoder start {start}")
        with torch.device("meta") if meta else contextlib.nullcontext():
            # On meta, no initialisation: a meta normal_ goes through torch's refs and imports torch._dynamo
            # (~1 s and ~100 MB of resident memory in a process that may have a tight memory budget).
            self.embed = nn.Embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None,
            )
            self.layers = nn.ModuleList(Block(cfg, info, self.codecs) for info in self.plan.layers)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.head = Linear(cfg.hidden_size, cfg.vocab_size)

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, *, seed: int = 0, exact: bool = False, token_map: torch.Tensor | None = None
    ) -> Transformer:
        """A model with seeded random weights (same seed → same weights, whatever the global RNG state).

        Raises:
            kvdiet.model.memory.InsufficientMemoryError: the weights cannot fit in the memory available
                (checked from the config, before anything is allocated).
        """
        check_fits(f"{cfg.name or 'the model'} with random weights", random_weights_bytes(cfg))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = cls(cfg, exact=exact, token_map=token_map)
            model.init_weights()
        return model.eval()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Matrices ~ N(0, 0.02²); norm weights, hc scales, Engram gate weights 1; biases and sinks 0."""
        for name, p in self.named_parameters():
            if name == "embed.weight":
                nn.init.normal_(p)
            elif p.dim() >= 2 and not name.endswith(("q_weight", "k_weight")):
                nn.init.normal_(p, std=_INIT_STD)

    @property
    def device(self) -> torch.device:
        """Where the weights live (`kvdiet.model.placement.place` moves them); pools and states follow."""
        return self.embed.weight.device

    # --- state ---

    def new_pool(
        self, num_blocks: int, *, block_size: int = DEFAULT_BLOCK_SIZE, blocks: BlockAllocator | None = None
    ) -> DevicePool:
        """A paged device pool of ``num_blocks`` blocks for this model's KV-source layers (`DevicePool`).

        ``blocks``: the allocator of its block ids (the cache layer's `BlockPool` of ``num_blocks``), or None
        for a private growable pool (a model used on its own). Raises ValueError as `DevicePool`.
        """
        ratios = {s: self.plan[s].compress_ratio for s in self.plan.kv_sources}
        return DevicePool(
            ratios,
            self.codecs,
            block_size=block_size,
            num_blocks=num_blocks,
            blocks=blocks,
            device=self.device,
        )

    def new_state(
        self, pool: DevicePool | None = None, *, blocks: list[int] | None = None, num_tokens: int = 0
    ) -> RequestState:
        """Caches for one request.

        Args:
            pool: the device pool holding its global KV; None → a private growable pool (a model used on
                its own, without an engine).
            blocks: block ids already holding this request's first ``num_tokens`` tokens (a prefix hit; the
                caller holds their references and gives them to the state).
            num_tokens: tokens those blocks cover — a multiple of the block size. Window rings and
                compressor tails start empty: the caller restores or replays them.
        Raises:
            ValueError: ``num_tokens`` does not match ``blocks``.
        """
        cfg, c = self.cfg, self.codecs
        pool = pool if pool is not None else self.new_pool(4)
        blocks = list(blocks or [])
        if num_tokens != len(blocks) * pool.block_size:
            raise ValueError(
                f"{len(blocks)} blocks hold {len(blocks) * pool.block_size} tokens, not {num_tokens}"
            )
        table = BlockTable(pool, blocks)
        dev = pool.device
        windows = WindowRings(c.window, cfg.sliding_window, len(self.plan.layers), device=dev)
        sources = self.plan.kv_sources
        ratio = {s: self.plan[s].compress_ratio for s in sources}
        tails = {s: CompressorTail(ratio[s], cfg.head_dim, device=dev) for s in sources if ratio[s] > 1}
        history = (
            self.hasher.initial_history() if self.hasher else torch.empty(0, dtype=torch.int64, device=dev)
        )
        return RequestState(
            windows,
            {s: PagedEntries(table, s, "main", num_tokens // ratio[s]) for s in sources},
            {s: PagedEntries(table, s, "index", num_tokens // ratio[s]) for s in sources},
            tails,
            table,
            history,
            num_tokens,
        )

    def check_tokens(self, tokens: Sequence[int] | torch.Tensor, *, start: int = 0) -> torch.Tensor:
        """Validate a chunk whose first token sits at position ``start``; returns int64 [T].

        Raises:
            ValueError: see `kvdiet.model.token_ids.check_token_ids`.
        """
        return check_token_ids(self.cfg, tokens, start=start)

    def rewind(self, state: RequestState, start: int, prefix_ids: Sequence[int] | torch.Tensor) -> None:
        """Reset a request's local state to position ``start``, keeping its global KV (encoder-side replay).

        Window rings and compressor tails are emptied and the Engram history is rebuilt from
        ``prefix_ids[:start]``; the next `prefill` recomputes from ``start``: its windows read nothing below
        ``start`` and it writes only global entries the request does not hold yet (v41-spec §7.2).

        Args:
            state: the request (its global KV covers at least ``start`` tokens).
            start: the replay start, a multiple of every compress ratio (so no group is split).
            prefix_ids: the request's token ids, at least ``start`` of them.
        Raises:
            ValueError: ``start`` out of range or not aligned, too few ids (nothing changes then).
        """
        align = self.plan.block_unit  # a replay starts where every KV source's groups do
        if not 0 <= start <= state.num_tokens or start % align:
            raise ValueError(
                f"replay start {start} must be in [0, {state.num_tokens}] and a multiple of {align}"
            )
        ids = torch.as_tensor(prefix_ids, dtype=torch.int64, device="cpu").flatten()  # host ids
        if ids.numel() < start:
            raise ValueError(f"replay from {start} needs the first {start} token ids, got {ids.numel()}")
        for ring in state.windows:
            ring.clear()
        for tail in state.tails.values():
            tail.clear()
        if self.hasher is not None:
            state.engram_history = self.hasher.history_after(ids[:start].to(self.device))
        state.num_tokens = start

    @contextlib.contextmanager
    def observe_selection(self, observer: Callable[[Selection], None]) -> Iterator[None]:
        """Inside the block, every compressed layer calls ``observer`` with the `Selection` of its rows."""
        attns = [b.attn for b in self.layers if b.info.compress_ratio]
        if any(a.selection_observer is not None for a in attns):
            raise RuntimeError("a selection observer is already installed")
        for attn in attns:
            attn.selection_observer = observer
        try:
            yield
        finally:
            for attn in attns:
                attn.selection_observer = None

    # --- forward paths ---

    @torch.no_grad()
    def prefill(
        self,
        state: RequestState,
        tokens: Sequence[int] | torch.Tensor,
        *,
        decoder_replay: bool = True,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Process a chunk of one request's tokens at positions ``state.num_tokens …``.

        Args:
            state: the request's caches (updated).
            tokens: int [T], T ≥ 1.
            decoder_replay: run the decoder layers only on the last ``sliding_window`` rows (see module doc).
            all_logits: return logits of every row that reached the head instead of the last one.
        Returns:
            fp32 [V] (last row) or [R, V] (R = T, or min(T, window) under bounded replay).
        Raises:
            ValueError: see `check_tokens`.
            ValueError: the state's block table on a shared pool does not cover the new tokens.
        """
        ids = self.check_tokens(tokens, start=state.num_tokens).to(self.device)  # token ids cross here
        keep = min(ids.numel(), self.cfg.sliding_window) if decoder_replay else ids.numel()
        with device_scope(self.device):
            logits = self._forward([state], [ids], [keep], last_row=not all_logits)
        return logits if all_logits else logits[-1]

    @torch.no_grad()
    def decode(self, states: Sequence[RequestState], tokens: Sequence[int]) -> torch.Tensor:
        """One token for each request: ``tokens[b]`` at position ``states[b].num_tokens``; returns fp32 [B, V].

        Raises:
            ValueError: lengths differ, a state appears twice, a token is invalid, or a block table on a
                shared pool does not cover its new token (nothing changes then).
        """
        ids = decode_token_ids(self.cfg, states, tokens).to(self.device)  # token ids cross here
        with device_scope(self.device):
            return self._forward(list(states), list(ids.split(1)), [1] * len(states))

    @staticmethod
    def _check_tables(states: list[RequestState], ids: list[torch.Tensor]) -> None:
        """Every state's block table must cover its new tokens: blocks are reserved before the forward by the
        cache layer (`kvdiet.cache.reserve.reserve_blocks`). A private growable pool (a model used on its
        own, `new_state` without a pool) grows here instead.

        Raises:
            ValueError: a table on a shared pool is too short (nothing changes then).
        """
        for state, chunk in zip(states, ids, strict=True):
            table, end = state.table, state.num_tokens + chunk.numel()
            if table.pool.growable:
                continue
            if len(table) * table.pool.block_size < end:
                raise ValueError(
                    f"the block table covers {len(table) * table.pool.block_size} tokens but the forward "
                    f"writes up to token {end}: reserve blocks before the forward "
                    f"(kvdiet.cache.reserve.reserve_blocks)"
                )
        for state, chunk in zip(states, ids, strict=True):
            if state.table.pool.growable:
                state.table.reserve(state.num_tokens + chunk.numel())

    def _forward(
        self, states: list[RequestState], ids: list[torch.Tensor], keeps: list[int], *, last_row: bool = False
    ) -> torch.Tensor:
        """Logits fp32 [R, V] of the rows that reach the head; with ``last_row`` only the last one's [1, V] (a
        prefill's caller needs no other: the head reads its V × hidden weights once instead of R times)."""
        cfg = self.cfg
        self._check_tables(states, ids)
        segs, row_ids, rows = [], {}, []
        sizes = [chunk.numel() for chunk in ids]
        if sizes.count(1) == len(sizes):  # a decode step: every request's position in one tensor, a view each
            positions = torch.tensor([s.num_tokens for s in states]).split(1)
        else:
            positions = [torch.arange(s.num_tokens, s.num_tokens + sizes[i]) for i, s in enumerate(states)]
        start = 0
        for state, pos, n in zip(states, positions, sizes, strict=True):
            segs.append(Segment(state, pos))
            rows.append((start, start + n))
            start += n
        histories: Sequence[torch.Tensor] = []  # each request's Engram history after this call
        if self.hasher is not None and start == len(segs):  # one id each: the batch's [B, N] hashed at once
            hist = torch.stack([s.engram_history for s in states])
            batch = self.hasher.with_history(self.hasher.compress(torch.cat(ids))[:, None], hist)
            histories = self.hasher.next_history(batch).unbind(0)  # a view each, one copy for all
            for layer in self.hasher.layer_ids:
                row_ids[layer] = self.hasher.row_ids(layer, batch).flatten(0, 1)
        elif self.hasher is not None:
            with_hist = [
                self.hasher.with_history(self.hasher.compress(c), s.engram_history)
                for s, c in zip(states, ids, strict=True)
            ]
            for layer in self.hasher.layer_ids:
                row_ids[layer] = torch.cat([self.hasher.row_ids(layer, w) for w in with_hist])
            histories = [self.hasher.next_history(w) for w in with_hist]
        # a decode step: a row a request
        plan = DecodePlan.for_segments(segs, self.plan) if start == len(segs) else None
        h = hc_init_streams(self.embed(torch.cat(ids)), cfg.hc_mult)
        checked = None if plan is None else prepare_step(self, plan, h)  # bindings checked, layers prepared
        prev_pre = hc_initial_pre(h.shape[0], cfg.hc_mult)
        for block in self.layers:
            layer = block.info.layer_id
            if block.engram is not None:
                h = block.engram(h, row_ids[layer])
            if layer == self.plan.decoder_start and any(
                k < (e - s) for k, (s, e) in zip(keeps, rows, strict=True)
            ):
                x = block.attn_norm(hc_collapse(h, prev_pre))
                for seg, (s, e) in zip(segs, rows, strict=True):
                    block.attn.update_global(x[s:e], seg)
                h, x, segs, rows = self._narrow(h, x, segs, rows, keeps)
                attn_pre, post, comb = block.coefficients(h, "attn")
                out = torch.cat(
                    [block.attn.attend_rows(x[s:e], seg) for seg, (s, e) in zip(segs, rows, strict=True)]
                )
            elif plan is not None:  # a decode step: the attention over the whole batch at once, then the FFN
                h, prev_pre = decode_layer(block, h, prev_pre, segs, plan, checked)
                continue
            else:
                x, attn_pre, post, comb = block.entry(h, "attn", prev_pre)
                outs = [block.attn(x[s:e], seg) for seg, (s, e) in zip(segs, rows, strict=True)]
                out = outs[0] if len(outs) == 1 else torch.cat(outs)  # one request's prefill: no copy
            h = hc_expand(out, h, post, comb)
            h, prev_pre = block.ffn_half(h, attn_pre)
        if plan is not None:
            plan.store_windows(segs)
        for i, (state, chunk) in enumerate(zip(states, ids, strict=True)):
            state.num_tokens += chunk.numel()
            if self.hasher is not None:
                state.engram_history = histories[i]
        if last_row:
            h, prev_pre = h[-1:], prev_pre[-1:]
        return self.head(self.norm(hc_collapse(h, prev_pre))).float()

    def _narrow(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        segs: list[Segment],
        rows: list[tuple[int, int]],
        keeps: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, list[Segment], list[tuple[int, int]]]:
        """Keep each segment's last ``keep`` rows; their windows read nothing before ``chunk end − window``."""
        w = self.cfg.sliding_window
        index, new_segs, new_rows, start = [], [], [], 0
        for seg, (s, e), keep in zip(segs, rows, keeps, strict=True):
            index.append(torch.arange(e - keep, e))
            floor = int(seg.positions[-1]) + 1 - w
            new_segs.append(seg.last_rows(keep, floor) if keep < e - s else seg)
            new_rows.append((start, start + keep))
            start += keep
        index = torch.cat(index)
        return h[index], x[index], new_segs, new_rows
