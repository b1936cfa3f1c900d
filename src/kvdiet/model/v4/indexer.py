"""V4-Flash's lightning indexer: which compressed entries each query of a CSA layer attends (v41-spec §3.2, §9).

DeepSeek's V4 reference ``Indexer``; transformers ``DeepseekV4Indexer``:
- **Keys**: the indexer's own overlapping compressor at ``index_head_dim`` (`V4Compressor`, its own ``wkv``,
  ``wgate``, ``ape`` and ``norm``), RoPE at the window's first position — one key per CSA entry.
- **Queries**: ``q = wq_b(qr)`` from the attention's normed q-LoRA output, viewed [index_n_heads,
  index_head_dim], RoPE at the query position.
- **Score** of entry j for a query: ``Σ_h relu(q_h · k_j) · index_head_dim^-½ · w_h`` with
  ``w = weights_proj(x) · index_n_heads^-½``; entries whose window is not complete at the query
  (``j ≥ (t + 1) // ratio``) get −inf.
- **Selection**: the top ``min(index_topk, entries)`` by score; picks that are not visible become −1.

With packed caches (the released model's way) index keys and queries are rotated by an orthonormal
Hadamard transform and rounded to MXFP4 (keys are stored that way, 68 B at d = 128); the rotation leaves
every q·k unchanged, so only the rounding differs from the exact path, which transformers computes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvdiet.formats.codec import Codec
from kvdiet.model.layers import Rope, widen
from kvdiet.model.linear import Linear
from kvdiet.model.v4.compressor import V4Compressor

__all__ = ["V4Indexer", "hadamard"]


@functools.cache
def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h * d**-0.5


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., d] times the orthonormal Sylvester-Hadamard matrix (natural order, scale d^-½), as DeepSeek's
    V4 reference ``rotate_activation``; same dtype.

    Raises:
        ValueError: d is not a power of two.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, got {d}")
    return x @ _sylvester(d).to(x.dtype)


class V4Indexer(nn.Module):
    """Parameters (DeepSeek names under ``layers.{i}.attn.indexer.``): ``wq_b`` [H·d, q_lora_rank],
    ``weights_proj`` [H, hidden], ``compressor`` (`V4Compressor`, overlapping, width d).

    Args:
        hidden_size / q_lora_rank: config widths.
        n_heads: H, config ``index_n_heads``; head_dim: d, config ``index_head_dim``.
        ratio: the CSA compress ratio (4); topk: config ``index_topk``; eps: config ``rms_norm_eps``.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.ratio, self.topk = n_heads, head_dim, ratio, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.compressor = V4Compressor(hidden_size, head_dim, ratio, overlap=True, eps=eps)

    def scores(
        self,
        qr: torch.Tensor,
        x: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rope: Rope,
        codec: Codec | None = None,
    ) -> torch.Tensor:
        """Scores [T, N] of keys [N, d] for the queries of rows ``x`` [T, hidden] (``qr`` [T, q_lora_rank]) at
        ``positions`` int64 [T]; −inf where the entry is not visible. With the index-key ``codec`` (packed
        caches) the keys are the stored, rotated ones and the queries are rotated and rounded the same way."""
        t = x.shape[0]
        q = self.wq_b(widen(qr)).view(t, self.n_heads, self.head_dim)
        q = rope.rotate(q.transpose(0, 1), positions).transpose(0, 1)  # [T, H, d]
        if codec is not None:
            q = codec.roundtrip(hadamard(q).float()).to(q.dtype)
        w = self.weights_proj(x) * self.n_heads**-0.5  # [T, H]
        logits = torch.einsum("thd,nd->thn", q, keys.to(q.dtype)).relu_() * self.head_dim**-0.5
        scores = torch.einsum("thn,th->tn", logits, w)
        visible = torch.arange(keys.shape[0])[None, :] < ((positions + 1) // self.ratio)[:, None]
        return scores.masked_fill_(~visible, float("-inf"))

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Entry ids int64 [T, min(topk, N)] of the best scores [T, N] (order unspecified), −1 where the pick is
        not visible to the query at ``positions`` [T] (fewer visible entries than picks)."""
        k = min(self.topk, scores.shape[1])
        ids = scores.topk(k, dim=-1).indices
        return ids.masked_fill_(ids >= ((positions + 1) // self.ratio)[:, None], -1)
