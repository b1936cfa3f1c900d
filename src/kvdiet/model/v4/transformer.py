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
Bad input raises ``ValueError`` before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.model.hc import add_sublayer_hc, hc_collapse, hc_expand, hc_init_streams, sublayer_coefficients
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear
from kvdiet.model.moe import MoE
from kvdiet.model.token_ids import check_token_ids, decode_token_ids
from kvdiet.model.v4.attention import V4Attention, V4LayerCache

__all__ = ["V4Block", "V4State", "V4Transformer"]

_INIT_STD = 0.02  # config ``initializer_range``


@dataclass
class V4State:
    """One request's caches: one `V4LayerCache` per layer and the tokens processed so far."""

    layers: list[V4LayerCache]
    num_tokens: int = 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held by kind, summed over layers (see `V4LayerCache.nbytes`)."""
        out: dict[str, int] = {}
        for cache in self.layers:
            for kind, n in cache.nbytes().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def global_bytes(self) -> int:
        """Bytes of global KV actually held: compressed entries and index keys of every layer."""
        held = self.nbytes()
        return held["entries"] + held["index_keys"]


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
        self, h: torch.Tensor, ids: torch.Tensor, rows: list[tuple[int, int, int, V4LayerCache]]
    ) -> torch.Tensor:
        """Streams h [R, hc, hidden] of token ids [R] → new streams; ``rows`` = (first row, end row, first
        position, cache) of each request's consecutive rows."""
        pre, post, comb = self.coefficients(h, "attn")
        x = self.attn_norm(hc_collapse(h, pre))
        out = torch.cat([self.attn(x[s:e], start, cache) for s, e, start, cache in rows])
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
        codecs = None if exact else CacheCodecs.for_v4(cfg.head_dim, cfg.index_head_dim, cfg.qk_rope_head_dim)
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

    def new_state(self) -> V4State:
        """Empty caches for one request."""
        return V4State([block.attn.new_cache(self.dtype) for block in self.layers])

    @torch.no_grad()
    def prefill(
        self, state: V4State, tokens: Sequence[int] | torch.Tensor, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Process a chunk of one request's tokens at positions ``state.num_tokens …`` (chunks may split any
        compressor window).

        Returns:
            logits [V] of the last row, or [T, V] of every row with ``all_logits``, in the compute dtype.
        Raises:
            ValueError: see `kvdiet.model.token_ids.check_token_ids`.
        """
        ids = check_token_ids(self.cfg, tokens, start=state.num_tokens)
        logits = self._forward([state], [ids])
        return logits if all_logits else logits[-1]

    @torch.no_grad()
    def decode(self, states: Sequence[V4State], tokens: Sequence[int]) -> torch.Tensor:
        """One token per request: ``tokens[b]`` at position ``states[b].num_tokens``; returns [B, V].

        Raises:
            ValueError: lengths differ, a state appears twice, or a token is invalid (nothing changes then).
        """
        ids = decode_token_ids(self.cfg, states, tokens)
        return self._forward(list(states), ids)

    def _forward(self, states: list[V4State], ids: list[torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        flat = torch.cat(ids)
        h = hc_init_streams(self.embed(flat), cfg.hc_mult)
        spans, start = [], 0
        for state, chunk in zip(states, ids, strict=True):
            spans.append((start, start + chunk.numel(), state))
            start += chunk.numel()
        for i, block in enumerate(self.layers):
            rows = [(s, e, state.num_tokens, state.layers[i]) for s, e, state in spans]
            h = block(h, flat, rows)
        for state, chunk in zip(states, ids, strict=True):
            state.num_tokens += chunk.numel()
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
