"""V4-Flash's compressor: one KV entry per ``ratio`` tokens, overlapping at ratio 4 (CSA), plain at 128 (HCA).

v41-spec §3.2 (DeepSeek's V4 reference ``Compressor``; transformers ``DeepseekV4CSACompressor`` /
``DeepseekV4HCACompressor``). For window j (tokens ``j·r … j·r + r − 1``) with per-token projections
``kv = wkv(x)``, ``score = wgate(x) + ape[t mod r]``:

- **plain** (HCA, r = 128): ``entry_j = norm(Σ_t kv_t ⊙ softmax_t(score_t))`` — a softmax over the window's
  r tokens taken per channel.
- **overlapping** (CSA, r = 4): ``wkv``/``wgate``/``ape`` are 2·D wide. Channels ``[:D]`` ("Ca") of window
  j − 1 and channels ``[D:]`` ("Cb") of window j are pooled together, a softmax over 2r rows per channel;
  window 0 has no previous Ca (weight 0).

Then RoPE at the window's first position ``j·r`` (the caller's table). The open window's rows wait in the
request's `CompressorTail` (rows ``[0, count)``); an overlapping compressor's tail has 2r rows, the last
complete window's projections first (rows ``[0, r)``, only their Ca half is read), the open rows after them
(``[r, r + count)``). So chunked prefill and single-token decode give exactly the entries of a one-shot pass.
A CSA layer's main and index compressors share one tail side by side (columns ``cols``; their windows move
together), and the caller sets ``tail.count`` once both have run.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.layers import RMSNorm, Rope, widen
from kvdiet.model.linear import Linear

__all__ = ["V4Compressor"]


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
        self, x: torch.Tensor, start_pos: int, tail: CompressorTail, cols: slice, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries of the windows completed by rows ``x`` at positions ``start_pos …``.

        Args:
            x: [T, hidden], consecutive positions from ``start_pos``.
            start_pos: position of ``x[0]``.
            tail: the request's tail of this layer; columns ``cols`` (``width`` of them) are this
                compressor's and are updated in place; ``tail.count`` is left to the caller.
            cols: this compressor's columns of the tail.
            rope: the layer's RoPE table (entries are rotated at their window's first position).
        Returns:
            ``(entries [M, D] after norm and RoPE, entry ids int64 [M])``, in x's compute dtype.
        Raises:
            ValueError: the tail does not hold exactly ``start_pos % ratio`` open rows (nothing changes then).
        """
        r, d = self.ratio, self.head_dim
        base = r if self.overlap else 0  # where the open rows start
        held = tail.count
        if held != start_pos % r:
            raise ValueError(
                f"compressor tail holds {held} rows but position {start_pos} needs {start_pos % r}"
            )
        x = widen(x)
        kv = self.wkv(x)
        score = self.wgate(x) + self.ape.to(kv.dtype)[torch.arange(start_pos, start_pos + x.shape[0]) % r]
        kv = torch.cat([tail.kv[base : base + held, cols].to(kv.dtype), kv])
        score = torch.cat([tail.score[base : base + held, cols].to(kv.dtype), score])
        m = kv.shape[0] // r
        first = (start_pos - held) // r
        rest_kv, rest_score = kv[m * r :], score[m * r :]
        entries = kv.new_empty(0, d)
        if m:
            win_kv, win_score = kv[: m * r].view(m, r, -1), score[: m * r].view(m, r, -1)
            if self.overlap:
                prev_kv = torch.cat([tail.kv[None, :r, cols][..., :d].to(kv.dtype), win_kv[:-1, :, :d]])
                prev_score = torch.cat(
                    [tail.score[None, :r, cols][..., :d].to(kv.dtype), win_score[:-1, :, :d]]
                )
                tail.kv[:r, cols], tail.score[:r, cols] = win_kv[-1], win_score[-1]
                win_kv = torch.cat([prev_kv, win_kv[..., d:]], dim=1)  # [m, 2r, D]
                win_score = torch.cat([prev_score, win_score[..., d:]], dim=1)
            pooled = (win_kv * torch.softmax(win_score, dim=1)).sum(dim=1)
            entries = rope.rotate(self.norm(pooled), torch.arange(first, first + m) * r)
        tail.kv[base:, cols], tail.score[base:, cols] = 0.0, float("-inf")
        tail.kv[base : base + rest_kv.shape[0], cols] = rest_kv
        tail.score[base : base + rest_kv.shape[0], cols] = rest_score
        return entries, torch.arange(first, first + m)
