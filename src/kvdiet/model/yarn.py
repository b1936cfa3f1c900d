"""RoPE's per-pair frequencies, with YaRN's blend for long contexts (DeepSeek's reference
``precompute_freqs_cis``; v41-spec §2). `kvdiet.model.layers.Rope` builds its tables from them."""

from __future__ import annotations

import math

import torch

__all__ = ["rope_frequencies"]


def rope_frequencies(
    rope_dim: int,
    base: float,
    *,
    factor: float = 1.0,
    original_max_position_embeddings: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    yarn: bool = False,
) -> torch.Tensor:
    """Per-pair angular frequencies (radians per position), fp32 [rope_dim/2].

    Follows DeepSeek's reference ``precompute_freqs_cis``: ``freqs_i = 1 / base**(2i/d)``; with ``yarn`` the
    fast pairs ``i ≤ low`` keep ``freqs``, slow pairs ``i ≥ high`` get ``freqs/factor``, and pairs between
    are blended linearly, with ``low = floor(corr(beta_fast))``, ``high = ceil(corr(beta_slow))``,
    ``corr(n) = d·ln(orig/(n·2π)) / (2·ln base)`` (both clamped to [0, d−1]; 0.001 is added to ``high`` when
    they are equal): ``ramp = clamp((i − low)/(high − low), 0, 1)``, ``smooth = 1 − ramp``,
    ``freqs = freqs/factor·(1 − smooth) + freqs·smooth``. No mscale: the rotation stays unit-modulus
    (v41-spec §2). The reference clamps only ``low`` from below and ``high`` from above; the two agree
    whenever ``low ≤ d − 1`` and ``high ≥ 0``, as for every shipped config.

    Raises:
        ValueError: odd or non-positive ``rope_dim``, ``base`` ≤ 1.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be even and > 0, got {rope_dim}")
    if base <= 1:
        raise ValueError(f"RoPE base must be > 1, got {base}")
    d = rope_dim
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    if not yarn:
        return freqs

    def corr(num_rotations: float) -> float:
        return (
            d
            * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = min(max(math.floor(corr(beta_fast)), 0), d - 1)
    high = min(max(math.ceil(corr(beta_slow)), 0), d - 1)
    if high == low:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth
