"""V4-Flash's compressor: one KV entry per ``ratio`` tokens, overlapping at ratio 4 (CSA), plain at 128 (HCA).

v41-spec §3.2 (DeepSeek's V4 reference ``Compressor``; transformers ``DeepseekV4CSACompressor`` /
``DeepseekV4HCACompressor``). For window j (tokens ``j·r … j·r + r − 1``) with per-token projections
``kv = wkv(x)``, ``score = wgate(x) + ape[t mod r]``:

- **plain** (HCA, r = 128): ``entry_j = norm(Σ_t kv_t ⊙ softmax_t(score_t))`` — a softmax over the window's
  r tokens taken per channel.
- **overlapping** (CSA, r = 4): ``wkv``/``wgate``/``ape`` are 2·D wide. Channels ``[:D]`` ("Ca") of window
  j − 1 and channels ``[D:]`` ("Cb") of window j are pooled together, a softmax over 2r rows per channel;
  window 0 has no previous Ca (weight 0).

Then RoPE at the window's first position ``j·r`` (the caller's table). The rows of an open window wait in
`CompressorState`, and an overlapping compressor also keeps the last complete window's Ca rows, so chunked
prefill and single-token decode give exactly the entries of a one-shot pass. The indexer of a CSA layer runs
its own overlapping compressor at ``index_head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvdiet.model.layers import RMSNorm, Rope, widen
from kvdiet.model.linear import Linear

__all__ = ["CompressorState", "V4Compressor"]


@dataclass
class CompressorState:
    """One request's open-window rows of one compressor.

    Attributes:
        kv / score: [m, C] the projections (score with ``ape`` added) of the open window's first m < r
            tokens, in the model's compute dtype (C = 2·D when overlapping, else D).
        prev_kv / prev_score: [r, D] the Ca channels of the last complete window (overlapping only), or None
            before the first window completes.
        entries: windows completed so far (entry ids ``0 … entries − 1``).
    """

    kv: torch.Tensor
    score: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    entries: int = 0

    @classmethod
    def empty(cls, width: int, dtype: torch.dtype = torch.float32) -> CompressorState:
        """A state with no rows: ``width`` = C."""
        return cls(torch.empty(0, width, dtype=dtype), torch.empty(0, width, dtype=dtype))

    @property
    def count(self) -> int:
        """Rows of the open window held (< ratio)."""
        return self.kv.shape[0]

    def nbytes(self) -> int:
        """Bytes held (the open rows and the carried Ca rows)."""
        held = [self.kv, self.score, self.prev_kv, self.prev_score]
        return sum(t.numel() * t.element_size() for t in held if t is not None)


class V4Compressor(nn.Module):
    """Parameters (DeepSeek names): ``wkv`` [C, hidden], ``wgate`` [C, hidden], ``ape`` fp32 [ratio, C],
    ``norm`` [D]; C = 2·D when ``overlap`` else D.

    Args:
        hidden_size: input width (config ``hidden_size``).
        head_dim: D, the entry width (``head_dim`` for main KV, ``index_head_dim`` for index keys).
        ratio: tokens per entry (4 or 128 in V4-Flash).
        overlap: pool each window with the previous one's Ca channels (CSA).
        eps: config ``rms_norm_eps``.
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = 2 * head_dim if overlap else head_dim
        self.wkv = Linear(hidden_size, width)
        self.wgate = Linear(hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, eps)

    @property
    def width(self) -> int:
        """C: the projection width (2·D when overlapping)."""
        return self.wkv.out_features

    def forward(
        self, x: torch.Tensor, start_pos: int, state: CompressorState, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries of the windows completed by rows ``x`` at positions ``start_pos …``.

        Args:
            x: [T, hidden], consecutive positions from ``start_pos``.
            start_pos: position of ``x[0]``.
            state: the request's open-window rows (updated in place).
            rope: the layer's RoPE table (entries are rotated at their window's first position).
        Returns:
            ``(entries [M, D] after norm and RoPE, entry ids int64 [M])``, in x's compute dtype.
        Raises:
            ValueError: the state does not end at ``start_pos`` (nothing changes then).
        """
        r, d = self.ratio, self.head_dim
        if state.entries * r + state.count != start_pos:
            raise ValueError(
                f"compressor state covers {state.entries * r + state.count} tokens but the chunk starts at "
                f"{start_pos}"
            )
        x = widen(x)
        kv = self.wkv(x)
        pos_in_window = torch.arange(start_pos, start_pos + x.shape[0]) % r
        score = self.wgate(x) + self.ape.to(kv.dtype)[pos_in_window]
        kv = torch.cat([state.kv.to(kv.dtype), kv])
        score = torch.cat([state.score.to(kv.dtype), score])
        m = kv.shape[0] // r
        first = state.entries
        state.kv, state.score = kv[m * r :].clone(), score[m * r :].clone()
        if m == 0:
            return kv.new_empty(0, d), torch.empty(0, dtype=torch.int64)
        kv, score = kv[: m * r].view(m, r, -1), score[: m * r].view(m, r, -1)
        if self.overlap:
            prev_kv = kv.new_zeros(m, r, d)
            prev_score = score.new_full((m, r, d), float("-inf"))
            prev_kv[1:], prev_score[1:] = kv[:-1, :, :d], score[:-1, :, :d]
            if state.prev_kv is not None:
                prev_kv[0], prev_score[0] = state.prev_kv, state.prev_score
            state.prev_kv, state.prev_score = kv[-1, :, :d].clone(), score[-1, :, :d].clone()
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [m, 2r, D]
            score = torch.cat([prev_score, score[..., d:]], dim=1)
        pooled = (kv * torch.softmax(score, dim=1)).sum(dim=1)
        ids = torch.arange(first, first + m)
        state.entries += m
        return rope.rotate(self.norm(pooled), ids * r), ids
