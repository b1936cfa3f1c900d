"""The V4.1 compressor of a KV-source (Full) layer: one pre-RoPE latent per ``compress_ratio`` tokens.

v41-spec §3.1 (DeepSeek's reference; vLLM ``fused_save_compress_norm``):
- ratio 1 (layer 20): ``latent_t = norm(wkv(x_t))``.
- ratio r > 1 (layers 2, 8, 14 at r = 2): for group j (tokens ``j·r … j·r + r − 1``),
  ``latent_j = norm(Σ_t wkv(x_t) ⊙ softmax_t(wgate(x_t)))`` — a softmax over the group's tokens taken per
  channel, in fp32; no overlap, no positional bias. A group's rows wait in the request's
  `CompressorTail` until its last token arrives, so chunk boundaries and single-token decode steps give
  exactly the latents of a one-shot pass (cases B03, B06).
The latent is returned before RoPE: the indexer derives its keys from it first (v41-spec §3.1, §4).
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear

__all__ = ["Compressor", "pool_groups"]


def pool_groups(kv: torch.Tensor, score: torch.Tensor, ratio: int) -> torch.Tensor:
    """Softmax-gated pooling of complete groups: ``kv``/``score`` fp32 [M·r, D] → [M, D]."""
    m, d = kv.shape[0] // ratio, kv.shape[1]
    kv, score = kv[: m * ratio].view(m, ratio, d), score[: m * ratio].view(m, ratio, d)
    return (kv * torch.softmax(score, dim=1)).sum(dim=1)


class Compressor(nn.Module):
    """Parameters ``wkv`` [head_dim, hidden], ``wgate`` (ratio > 1 only) and ``norm`` [head_dim]."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(hidden_size, head_dim)
        self.wgate = Linear(hidden_size, head_dim) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, start_pos: int, tail: CompressorTail | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents of the groups completed by rows ``x`` at positions ``start_pos …``.

        Args:
            x: fp32 [T, hidden], consecutive positions from ``start_pos``.
            start_pos: position of ``x[0]``.
            tail: the request's open-group rows (ratio > 1); updated in place. None → no state (the no-cache
                reference passes whole sequences starting at 0).
        Returns:
            ``(latents fp32 [M, head_dim] pre-RoPE, group ids int64 [M])``.
        Raises:
            ValueError: the tail does not hold exactly ``start_pos % ratio`` rows.
        """
        r = self.ratio
        kv = self.wkv(x).float()
        if r == 1:
            return self.norm(kv), torch.arange(start_pos, start_pos + x.shape[0])
        score = self.wgate(x).float()
        held = tail.count if tail is not None else 0
        if held != start_pos % r:
            raise ValueError(
                f"compressor tail holds {held} rows but position {start_pos} needs {start_pos % r}"
            )
        if held:
            kv = torch.cat([tail.kv[:held], kv])
            score = torch.cat([tail.score[:held], score])
        first = start_pos - held
        m = kv.shape[0] // r
        if tail is not None:
            tail.replace(kv[m * r :], score[m * r :])
        latents = self.norm(pool_groups(kv, score, r))
        return latents, torch.arange(first // r, first // r + m)
