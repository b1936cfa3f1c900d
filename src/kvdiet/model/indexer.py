"""The V4.1 lightning indexer: index keys (owners), index queries, scores (v41-spec §4).

- Keys (KV-source layers only): ``k = k_norm(wk(latent))`` from the compressor's pre-RoPE latent, RoPE on
  the last ``qk_rope_head_dim`` dims at the group's first position, then the MXFP4 round trip.
- Queries (every index source): ``q = wq_b(qr)`` from the main attention's q-LoRA output ``qr``, viewed
  [index_n_heads, index_head_dim], RoPE at the query position, MXFP4 round trip. No Hadamard rotation.
- Score of entry j for a query: ``Σ_h relu(q_h · k_j) · w_h`` with
  ``w = weights_proj(x) · index_head_dim^-½ · index_n_heads^-½``; entries the query may not see get −inf
  (computed on the stored keys by `kvdiet.model.index_scores`).
A layer scores against the keys of its own KV source ``kv_src(l)`` on every call, including decode steps
that complete no group (v41-spec §4: DeepSeek's reference re-points the key slot only when the owner
emits, which makes its decode disagree with its prefill; kvdiet does not).
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.formats.codec import Codec
from kvdiet.formats.mxfp4 import INDEX_KEY, decode_index_key, encode_index_key
from kvdiet.formats.scales import PendingCheck
from kvdiet.model.fused_rows import fused_kernels, project_rows
from kvdiet.model.layers import RMSNorm, Rotation, as_dtype
from kvdiet.model.linear import Linear
from kvdiet.model.member import member

__all__ = ["Indexer"]


class Indexer(nn.Module):
    """Parameters ``wq_b`` [H·d, q_lora_rank], ``weights_proj`` [H, hidden]; owners add ``wk`` [d, head_dim]
    and ``k_norm`` [d] (DeepSeek checkpoint names under ``layers.{i}.attn.indexer.``)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_head_dim: int,
        owns_keys: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.n_heads, self.index_head_dim = n_heads, index_head_dim
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.wk = Linear(head_dim, index_head_dim) if owns_keys else None
        self.k_norm = RMSNorm(index_head_dim, eps) if owns_keys else None
        self.softmax_scale = (index_head_dim**-0.5) * (n_heads**-0.5)

    def keys(self, latent: torch.Tensor, rot: Rotation, *, decode_step: bool = False) -> torch.Tensor:
        """Index keys fp32 [M, d] (after RoPE, before storage) of pre-RoPE ``latent`` [M, head_dim]; ``rot``: the
        layer's ``rope.at(group_pos [M])``, each group's first position.

        ``decode_step``: the groups a batched decode step closes (1..16 rows); they run in one compiled call
        where `project_rows` applies (no hook on ``wk`` or ``k_norm``: `fused_rows.fused_kernels`), the same
        kernel calls in the same order, so the same bits. Prefill and the reference (`kvdiet.model.reference`)
        take the modules, so the reference stays independent of that kernel."""
        mods = self._modules  # no nn.Module attribute fallback (about a microsecond a lookup)
        wk, k_norm = mods["wk"], mods["k_norm"]
        fused = project_rows(latent, wk, k_norm, None, 1, self.index_head_dim, rot) if decode_step else None
        return rot.apply(k_norm(wk(latent))) if fused is None else fused[1]

    def queries(
        self,
        qr: torch.Tensor,
        x: torch.Tensor,
        rot: Rotation,
        codec: Codec,
        *,
        pending: list[PendingCheck] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q fp32 [T, H, d] after RoPE and the MXFP4 round trip, w fp32 [T, H])`` for rows at the positions
        of ``rot`` (the layer's ``rope.at(positions [T])``).

        A decode step's rows (1..16 fp32 CPU rows, no autograd, dense weights, the packed MXFP4 codec, the
        rotation kernel checked) run in one compiled call (``index_query_rows``, ``formats/projection_kernels.cpp``:
        the same kernel calls in the same order, so the same bits). ``pending``: None checks the queries now; a
        list gets the encode's check appended (`Codec.encode_deferred`: no host read on the pure-torch path; a
        non-finite query reads as finite values meanwhile); the decode of the bytes encode wrote is never
        checked then (their scale bytes lie in the written range).

        Raises:
            ValueError: a non-finite query (the codec's encode; ``pending`` None).
        """
        fused = self._fused_queries(qr, x, rot, codec)
        if fused is not None:
            return fused
        t = qr.shape[0]
        q = as_dtype(self.wq_b(qr), torch.float32).view(t, self.n_heads, self.index_head_dim)
        q = rot.apply(q.transpose(0, 1)).transpose(0, 1)
        q = (
            codec.roundtrip(q)
            if pending is None
            else codec.decode_deferred(codec.encode_deferred(q, pending), [])
        )
        w = as_dtype(self.weights_proj(x), torch.float32) * self.softmax_scale
        return q, w

    def _fused_queries(
        self, qr: torch.Tensor, x: torch.Tensor, rot: Rotation, codec: Codec
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`queries` in one ``index_query_rows`` call where it applies (see `queries`), else None."""
        if codec.encode is not encode_index_key or codec.decode is not decode_index_key:
            return None  # another codec (exact mode) rounds otherwise
        if x.dtype != torch.float32 or not x.is_cpu:
            return None
        mods = self._modules  # no nn.Module attribute fallback (about a microsecond a lookup)
        wq_b, weights_proj = mods["wq_b"], mods["weights_proj"]
        kernels = fused_kernels(qr, wq_b, weights_proj, rot.rope_dim)
        if kernels is None:
            return None
        lo, hi = INDEX_KEY.scale_bytes
        return kernels.index_query_rows(
            qr, member(wq_b, "weight"), self.n_heads, self.index_head_dim, rot.cis, rot.rope_dim, x,
            member(weights_proj, "weight"), self.softmax_scale, INDEX_KEY.kernel, lo, hi, codec.width,
        )  # fmt: skip
