"""The DeepSeek-V4-Flash text model: embedding, mHC blocks (SWA, CSA and HCA attention, hash-routed and top-k
MoE), a learned mHC head, final norm and LM head (v41-spec §1.3, §3.2, §9).

DeepSeek's V4 reference ``model.py``; transformers ``DeepseekV4ForCausalLM`` (the peer the tests hold this
model to). Differences from V4.1 (`kvdiet.model.transformer`): every compressed layer owns its compressor
(no shared KV sources), CSA (ratio 4) pools overlapping windows and selects with its own indexer, HCA (ratio
128) attends every complete entry; each sublayer uses its own mHC pre-mix (no V4.1 shift); the streams are
collapsed by a learned head (``hc_head_*``) before the final norm; no Engram; the first ``num_hash_layers``
MoE layers route by token id (``tid2eid``).

Block l: ``pre, post, comb = mHC(h)``; ``h = post·attn(attn_norm(Σ pre_i h_i)) + combᵀ h``; the same with the
FFN (``ffn_norm``, MoE). Parameters carry DeepSeek's checkpoint names, so a DeepSeek-format state dict loads
with `torch.nn.Module.load_state_dict`. Computes in fp32, or in fp64 after ``model.double()``. Caches are
packed as V4-Flash stores them (584-B FP8 records, MXFP4 index keys; `V4Attention`) unless ``exact``.

Request state is the engine's `RequestState`: a 128-slot window ring per layer, main KV of every CSA and
HCA layer and index keys of every CSA layer in the paged device pool (`new_pool`, blocks a multiple of 128
tokens), one compressor tail per compressed layer. So the engine's prefix cache, tiers, SWA pool and
policies run V4-Flash as they run V4.1; V4 has no decoder side, so prefill never narrows.
Bad input raises ``ValueError`` before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.layer_plan import V4_BLOCK_SIZE, LayerPlan
from kvdiet.model.block_ids import BlockAllocator
from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.hc import add_sublayer_hc, hc_collapse, hc_expand, hc_init_streams, sublayer_coefficients
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear
from kvdiet.model.moe import MoE
from kvdiet.model.paged_pool import DevicePool
from kvdiet.model.state import BlockTable, PagedEntries, RequestState, WindowRing
from kvdiet.model.token_ids import check_token_ids, decode_token_ids
from kvdiet.model.transformer import Transformer
from kvdiet.model.v4.attention import V4Attention

__all__ = ["V4Block", "V4Transformer"]


_INIT_STD = 0.02  # config ``initializer_range``


class V4Block(nn.Module):
    """One layer (``layers.{i}.*``): ``attn_norm``, ``attn`` (`V4Attention`), ``ffn_norm``, ``ffn`` (`MoE`,
    hash-routed below ``num_hash_layers``), ``hc_attn_{fn,base,scale}`` and ``hc_ffn_{fn,base,scale}``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, codecs: CacheCodecs | None) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = V4Attention(cfg, cfg.layer_ratios[layer_id], codecs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, hash_routed=layer_id < (cfg.num_hash_layers or 0))
        add_sublayer_hc(self, cfg)

    def coefficients(self, h: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC ``(pre, post, comb)`` of the ``attn`` or ``ffn`` sublayer for streams ``h`` [T, hc, hidden]."""
        return sublayer_coefficients(self, self.cfg, h, part)

    def forward(
        self, h: torch.Tensor, ids: torch.Tensor, rows: list[tuple[int, int, RequestState]]
    ) -> torch.Tensor:
        """Streams h [R, hc, hidden] of token ids [R] → new streams; ``rows`` = (first row, end row, state) of
        each request's consecutive rows (its first at ``state.num_tokens``)."""
        pre, post, comb = self.coefficients(h, "attn")
        x = self.attn_norm(hc_collapse(h, pre))
        out = torch.cat([self.attn(x[s:e], st.num_tokens, st, self.layer_id) for s, e, st in rows])
        h = hc_expand(out, h, post, comb)
        pre, post, comb = self.coefficients(h, "ffn")
        out = self.ffn(self.ffn_norm(hc_collapse(h, pre)), ids)
        return hc_expand(out, h, post, comb)


class V4Transformer(nn.Module):
    """DeepSeek-V4-Flash text model (MTP/DSpark blocks out of scope).

    Parameters: ``embed``, ``layers`` (`V4Block`), ``hc_head_fn`` [hc, hc·hidden], ``hc_head_base`` [hc],
    ``hc_head_scale`` [1], ``norm``, ``head``.

    Args:
        cfg: a V4 config.
        exact: keep caches unquantised in the compute dtype instead of V4-Flash's packed formats.
    Raises:
        ValueError: a V4.1 config, a compressed layer whose ratio is not 4 (CSA) or 128 (HCA), or (packed)
            widths the formats cannot hold (see `CacheCodecs.for_v4`).
    """

    def __init__(self, cfg: ModelConfig, *, exact: bool = False) -> None:
        super().__init__()
        if cfg.is_v41:
            raise ValueError(f"config {cfg.name!r} is {cfg.model_type}; V4Transformer implements V4-Flash")
        odd = sorted({r for r in cfg.layer_ratios if r not in (0, 4, 128)})
        if odd:
            raise ValueError(f"V4-Flash layers compress at ratio 4 (CSA) or 128 (HCA), not {odd}")
        self.cfg, self.exact = cfg, exact
        self.plan = LayerPlan.from_config(cfg)
        self.hasher = None  # no Engram in V4-Flash
        self.weights_digest = ""  # set by a loader for weights not held in memory
        self.load_report = None
        codecs = self._codecs(torch.float32)
        hc = cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4Block(cfg, i, codecs) for i in range(cfg.num_hidden_layers))
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size)

    @classmethod
    def from_config(cls, cfg: ModelConfig, *, seed: int = 0, exact: bool = False) -> V4Transformer:
        """A model with seeded random weights: matrices ~ N(0, 0.02²), the embedding ~ N(0, 1), norms and mHC
        scales 1, biases, sinks and ``ape`` 0, and each hash layer's ``tid2eid`` a seeded draw of distinct
        experts per token id (same seed → same weights, whatever the global RNG state)."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = cls(cfg, exact=exact)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name == "embed.weight":
                        nn.init.normal_(p)
                    elif p.dim() >= 2 and not name.endswith(".ape"):
                        nn.init.normal_(p, std=_INIT_STD)
                for block in model.layers:
                    gate = block.ffn.gate
                    if gate.tid2eid is not None:
                        n_experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                        draws = torch.rand(cfg.vocab_size, n_experts).argsort(dim=1)[:, :k]
                        gate.tid2eid.copy_(draws)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: fp32, or fp64 after ``model.double()``."""
        return self.embed.weight.dtype

    @property
    def codecs(self) -> CacheCodecs:
        """The cache codecs: V4-Flash's packed formats, or exact rows of the compute dtype."""
        return self._codecs(self.dtype)

    def _codecs(self, dtype: torch.dtype) -> CacheCodecs:
        c = self.cfg
        return CacheCodecs.for_v4(
            c.head_dim, c.index_head_dim, c.qk_rope_head_dim, exact=self.exact, dtype=dtype
        )

    def new_pool(
        self, num_blocks: int, *, block_size: int = V4_BLOCK_SIZE, blocks: BlockAllocator | None = None
    ) -> DevicePool:
        """A paged device pool of ``num_blocks`` blocks: main KV of every compressed layer, index keys of the
        CSA layers. Raises ValueError as `DevicePool` (e.g. a block size that is not a multiple of 128)."""
        sources = self.plan.kv_sources
        ratios = {s: self.plan[s].compress_ratio for s in sources}
        indexed = frozenset(s for s in sources if self.plan[s].owns_index_keys)
        return DevicePool(
            ratios, self.codecs, block_size=block_size, num_blocks=num_blocks, blocks=blocks, indexed=indexed
        )

    def new_state(
        self, pool: DevicePool | None = None, *, blocks: list[int] | None = None, num_tokens: int = 0
    ) -> RequestState:
        """Caches for one request (as `kvdiet.model.transformer.Transformer.new_state`): its global KV in
        ``pool`` (None → a private growable pool) on ``blocks`` covering ``num_tokens`` tokens; window rings
        and compressor tails start empty.

        Raises:
            ValueError: ``num_tokens`` does not match ``blocks``.
        """
        pool = pool if pool is not None else self.new_pool(4)
        blocks = list(blocks or [])
        if num_tokens != len(blocks) * pool.block_size:
            raise ValueError(
                f"{len(blocks)} blocks hold {len(blocks) * pool.block_size} tokens, not {num_tokens}"
            )
        table, codecs, dtype = BlockTable(pool, blocks), self.codecs, self.dtype
        sources = self.plan.kv_sources
        tails = {}
        for s in sources:
            attn = self.layers[s].attn
            rows = 2 * attn.ratio if attn.compressor.overlap else attn.ratio
            tails[s] = CompressorTail(rows, attn.tail_width, dtype)
        return RequestState(
            [WindowRing(codecs.window, self.cfg.sliding_window) for _ in self.layers],
            {s: PagedEntries(table, s, "main", num_tokens // self.plan[s].compress_ratio) for s in sources},
            {
                s: PagedEntries(table, s, "index", num_tokens // self.plan[s].compress_ratio)
                for s in sources
                if self.plan[s].owns_index_keys
            },
            tails,
            table,
            num_tokens=num_tokens,
        )

    def check_tokens(self, tokens: Sequence[int] | torch.Tensor, *, start: int = 0) -> torch.Tensor:
        """Validate a chunk whose first token sits at position ``start``; returns int64 [T] (see
        `kvdiet.model.token_ids.check_token_ids`)."""
        return check_token_ids(self.cfg, tokens, start=start)

    def rewind(self, state: RequestState, start: int, prefix_ids: Sequence[int] | torch.Tensor) -> None:
        """Reset a request's window rings and compressor tails to position ``start``, keeping its global KV;
        the next `prefill` recomputes from ``start`` and writes only entries the request does not hold yet.

        Args:
            state: the request (its global KV covers at least ``start`` tokens).
            start: the replay start, a multiple of 128 (no HCA window is split).
            prefix_ids: the request's token ids (unused: V4-Flash keeps no token history; kept for the
                engine's one interface).
        Raises:
            ValueError: ``start`` out of range or not aligned (nothing changes then).
        """
        align = self.plan.block_unit  # a replay starts where every KV source's groups do
        if not 0 <= start <= state.num_tokens or start % align:
            raise ValueError(
                f"replay start {start} must be in [0, {state.num_tokens}] and a multiple of {align}"
            )
        for ring in state.windows:
            ring.clear()
        for tail in state.tails.values():
            tail.clear()
        state.num_tokens = start

    @torch.no_grad()
    def prefill(
        self,
        state: RequestState,
        tokens: Sequence[int] | torch.Tensor,
        *,
        decoder_replay: bool = False,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Process a chunk of one request's tokens at positions ``state.num_tokens …`` (chunks may split any
        compressor window). ``decoder_replay`` is accepted for the engine's one interface and does nothing:
        V4-Flash has no decoder side to narrow.

        Returns:
            logits [V] of the last row, or [T, V] of every row with ``all_logits``, in the compute dtype.
        Raises:
            ValueError: see `kvdiet.model.token_ids.check_token_ids`.
        """
        ids = check_token_ids(self.cfg, tokens, start=state.num_tokens)
        self._check_tables([state], [ids])
        logits = self._forward([state], [ids], last_row=not all_logits)
        return logits if all_logits else logits[-1]

    @torch.no_grad()
    def decode(self, states: Sequence[RequestState], tokens: Sequence[int]) -> torch.Tensor:
        """One token per request: ``tokens[b]`` at position ``states[b].num_tokens``; returns [B, V].

        Raises:
            ValueError: lengths differ, a state appears twice, or a token is invalid (nothing changes then).
        """
        ids = list(decode_token_ids(self.cfg, states, tokens).split(1))
        self._check_tables(list(states), ids)
        return self._forward(list(states), ids)

    _check_tables = staticmethod(Transformer._check_tables)

    def _forward(
        self, states: list[RequestState], ids: list[torch.Tensor], *, last_row: bool = False
    ) -> torch.Tensor:
        """Logits [R, V] of every row; with ``last_row`` only the last one's [1, V] (all a prefill's caller
        needs: the head reads its weights once)."""
        cfg = self.cfg
        flat = torch.cat(ids)
        h = hc_init_streams(self.embed(flat), cfg.hc_mult)
        rows, start = [], 0
        for state, chunk in zip(states, ids, strict=True):
            rows.append((start, start + chunk.numel(), state))
            start += chunk.numel()
        for block in self.layers:
            h = block(h, flat, rows)
        for state, chunk in zip(states, ids, strict=True):
            state.num_tokens += chunk.numel()
        if last_row:
            h = h[-1:]
        return self.head(self.norm(self._collapse_head(h)))

    def _collapse_head(self, h: torch.Tensor) -> torch.Tensor:
        """The learned final collapse: ``pre = σ(mixes·scale + base) + hc_eps``, ``Σ pre_i h_i`` (v41-spec §9)."""
        cfg = self.cfg
        flat = h.flatten(-2)
        mixes = (flat @ self.hc_head_fn.to(flat.dtype).T) * torch.rsqrt(
            flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps
        )
        pre = torch.sigmoid(mixes * self.hc_head_scale.to(flat.dtype) + self.hc_head_base.to(flat.dtype))
        return hc_collapse(h, pre + cfg.hc_eps)
