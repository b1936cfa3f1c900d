"""Compute cost of prefill and replay, from the config alone: FLOPs per token, and GPU-seconds on a named GPU.

The trace study charges every token a request computes (its prompt past the adopted hit, plus the tokens a
restore plan recomputes) with the FLOPs of the layers that run on it, and turns FLOPs into time with

    GPU-seconds = FLOPs / (peak dense FP8 rate of the GPU × MFU)

A model, not a measurement: it counts matrix work only, which dominates at these sizes.

- **Linear layers**: 2 FLOPs per active parameter per token. A layer's active parameters are its attention
  projections (q-LoRA ``wq_a``/``wq_b``, window ``wkv``, grouped output LoRA ``wo_a``/``wo_b``), its
  compressor gates and indexer projections where it owns them, the router, the shared experts and
  ``num_experts_per_tok`` routed experts of ``3 × hidden × moe_intermediate_size`` each — the same matrices
  `kvdiet.weights.estimate_weights` counts. Engram lookups and norms are ignored.
- **Attention**: a query at position p reads ``min(p + 1, W)`` window entries plus, on a compressed layer,
  ``min(index_topk, p // ratio)`` selected entries (V4 HCA layers: all ``p // ratio``); QKᵀ and PV cost
  ``4 × heads × head_dim`` FLOPs per entry read. An indexer scores every visible entry of its layer at
  ``2 × index_n_heads × index_head_dim`` FLOPs each (V4.1's hierarchical candidate pool only lowers this).
- **Which layers run** (v41-spec §6): V4 runs every layer on every token. V4.1's prefill runs the encoder
  layers on every token, layer ``decoder_start``'s shared KV projection on every token, and the decoder
  layers only on the chunk's last W rows (bounded decoder replay) — unless the policy needs every token's
  window entries (``full-store``), when the decoder runs on every row. Replayed tokens (rebuilding window
  state) run through every layer, since every layer has a window.
- **LM head**: ``2 × hidden × vocab`` once per prefill (the next-token logits).

GPU rates are NVIDIA's datasheet figures for dense FP8 Tensor Core math (the sparsity figures halved):
H100/H200 SXM 1,979 TFLOPS, B200 4,500 TFLOPS. The default MFU of 0.5 is an assumption; set it with
``--mfu``.
"""

from __future__ import annotations

from kvdiet.config import ModelConfig
from kvdiet.layer_plan import LayerPlan, Role

__all__ = ["GPU_FP8_FLOPS", "CostModel", "check_gpu"]

GPU_FP8_FLOPS = {"h100": 1979e12, "h200": 1979e12, "b200": 4500e12}
"""Dense FP8 Tensor Core FLOP/s per GPU (NVIDIA H100/H200 and B200 datasheets, without sparsity)."""

FORMULA = "GPU-seconds = FLOPs / ({gpu} dense FP8 {rate:.0f} TFLOP/s × MFU {mfu:g})"


def check_gpu(gpu: str, mfu: float) -> None:
    """Raises ValueError for a GPU not in `GPU_FP8_FLOPS` or an MFU outside (0, 1]."""
    if gpu not in GPU_FP8_FLOPS:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPU_FP8_FLOPS)}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")


def _sum_min_floor(n: int, cap: int, ratio: int) -> int:
    """Σ_{p=0}^{n−1} min(cap, p // ratio)."""
    if n <= 0 or ratio <= 0:
        return 0
    m = min(n, cap * ratio)
    q, rem = divmod(m, ratio)
    return ratio * q * (q - 1) // 2 + rem * q + cap * max(0, n - cap * ratio)


def _window_reads(n: int, w: int) -> int:
    """Σ_{p=0}^{n−1} min(p + 1, w): window entries read by the first n queries."""
    m = min(n, w)
    return m * (m + 1) // 2 + w * max(0, n - w)


_ALL = 1 << 62  # "no top-k cap": V4 HCA layers and indexers see every visible entry


class CostModel:
    """FLOPs of prefill and replay for one config, and their GPU-seconds.

    Args:
        cfg: a V4-family config (V4.1 or V4).
        gpu: a key of `GPU_FP8_FLOPS`.
        mfu: model FLOPs utilisation in (0, 1].
    Raises:
        ValueError: unknown GPU or MFU outside (0, 1].
    """

    # A plain class whose per-config tables are built once in ``__init__`` (the compiled simulator core,
    # `kvdiet.sim.simcore`, has no cached_property).
    def __init__(self, cfg: ModelConfig, gpu: str = "h200", mfu: float = 0.5) -> None:
        check_gpu(gpu, mfu)
        self.cfg, self.gpu, self.mfu = cfg, gpu, mfu
        self.flops_per_second: float = GPU_FP8_FLOPS[gpu] * mfu
        """Effective FLOP/s: peak × MFU."""
        self._plan = LayerPlan.from_config(cfg)
        self._layer_linear = self._linear_per_layer()
        self._classes = self._layer_classes()
        self._terms = self._cumulative_terms()
        # `_cumulative` of each layer set, by position: a trace's prompts end at the same positions again
        self._memo: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        start = self._plan.decoder_start
        # FLOPs per token of the decoder's shared KV projection (layer ``decoder_start``; 0 without a decoder)
        self._shared_kv_flops = 0 if start is None else 2 * self._kv_params(self._plan[start])

    @property
    def formula(self) -> str:
        """The time formula with this model's numbers, for reports."""
        return FORMULA.format(gpu=self.gpu.upper(), rate=GPU_FP8_FLOPS[self.gpu] / 1e12, mfu=self.mfu)

    def seconds(self, flops: float) -> float:
        """GPU-seconds for ``flops``."""
        return flops / self.flops_per_second

    def _linear_per_layer(self) -> tuple[int, ...]:
        """Linear FLOPs per token of each layer (2 × active parameters)."""
        c, h = self.cfg, self.cfg.hidden_size
        attn = (
            h * c.q_lora_rank
            + c.q_lora_rank * c.num_attention_heads * c.head_dim
            + h * c.head_dim
            + c.num_attention_heads * c.head_dim * c.o_lora_rank
            + c.o_groups * c.o_lora_rank * h
        )
        expert = 3 * h * c.moe_intermediate_size
        ffn = (c.n_shared_experts + c.num_experts_per_tok) * expert + h * c.n_routed_experts
        out = []
        for info in self._plan.layers:
            out.append(2 * (attn + ffn + self._kv_params(info)))
        return tuple(out)

    def _kv_params(self, info) -> int:
        """Compressor and indexer parameters a layer owns (as `estimate_weights` counts them)."""
        c, h = self.cfg, self.cfg.hidden_size
        n = 0
        if info.owns_compressed_kv:
            n += (1 if (c.is_v41 and info.compress_ratio == 1) else 2) * h * c.head_dim
        if info.owns_indexer:
            n += c.q_lora_rank * c.index_n_heads * c.index_head_dim + h * c.index_n_heads
        if info.owns_index_keys:
            n += c.head_dim * c.index_head_dim
        return n

    def _layer_classes(self) -> dict[int, tuple[int, tuple[tuple[int, int, int, bool], ...]]]:
        """Per layer set (0 every layer, 1 encoder, 2 decoder): linear FLOPs per token, and the attention
        classes ``(count, ratio, cap, owns_indexer)`` of its layers (few distinct ones)."""
        plan, cfg = self._plan, self.cfg
        start = plan.decoder_start if plan.decoder_start is not None else len(plan.layers)
        sets = {0: range(len(plan.layers)), 1: range(start), 2: range(start, len(plan.layers))}
        out = {}
        for key, layers in sets.items():
            counts: dict[tuple[int, int, bool], int] = {}
            for i in layers:
                info = plan[i]
                cap = _ALL if info.role is Role.HCA else cfg.index_topk
                sig = (info.compress_ratio, cap, info.owns_indexer)
                counts[sig] = counts.get(sig, 0) + 1
            linear = sum(self._layer_linear[i] for i in layers)
            out[key] = (linear, tuple((k, *sig) for sig, k in sorted(counts.items())))
        return out

    def _layers_flops(self, which: int, a: int, b: int) -> float:
        """FLOPs of queries at positions ``[a, b)`` through layer set ``which`` (see `_classes`)."""
        if b <= a:
            return 0.0
        memo = self._memo[which]
        hi, lo = memo.get(b), memo.get(a)
        if hi is None:
            hi = memo[b] = self._cumulative(which, b)
        if lo is None:
            lo = memo[a] = self._cumulative(which, a)
        return float(hi - lo)

    def _cumulative_terms(self) -> dict[int, tuple[int, int, tuple[tuple[int, int, int, int, int], ...]]]:
        """`_classes` as the coefficients `_cumulative` multiplies, per layer set: linear FLOPs per token, FLOPs
        per window entry read (every layer of the set reads its window), and per compressed class
        ``(ratio, cap × ratio, cap, FLOPs per selected entry read, FLOPs per indexer score)``."""
        c = self.cfg
        per_read = 4 * c.num_attention_heads * c.head_dim
        per_score = 2 * c.index_n_heads * c.index_head_dim
        out = {}
        for which, (linear, classes) in self._classes.items():
            window = sum(count for count, *_ in classes) * per_read
            compressed = tuple(
                (ratio, cap * ratio, cap, count * per_read, count * per_score if indexer else 0)
                for count, ratio, cap, indexer in classes
                if ratio
            )
            out[which] = (linear, window, compressed)
        return out

    def _cumulative(self, which: int, n: int) -> int:
        """FLOPs of queries at positions ``[0, n)`` through layer set ``which`` (exact integer): per layer,
        ``linear × n + per_read × (Σ_p min(p + 1, W) + Σ_p min(cap, p // ratio)) + per_score × Σ_p p // ratio``
        (`_window_reads`, `_sum_min_floor`), with the sums written out (one call per new position)."""
        linear, window, compressed = self._terms[which]
        w = self.cfg.sliding_window
        flops = linear * n + window * (n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + w * (n - w))
        for ratio, span, cap, per_read, per_score in compressed:
            q, rem = divmod(n, ratio)
            every = ratio * q * (q - 1) // 2 + rem * q  # Σ_p p // ratio
            if per_read:
                flops += per_read * (every if n <= span else ratio * cap * (cap - 1) // 2 + cap * (n - span))
            if per_score:
                flops += per_score * every
        return flops

    def prefill_flops(self, start: int, end: int, *, decoder_every_row: bool = False) -> float:
        """FLOPs to prefill positions ``[start, end)`` after ``start`` cached tokens (one chunk).

        ``decoder_every_row``: V4.1's decoder runs on every row (the ``full-store`` policy) instead of the
        last W. Returns 0.0 for an empty span.
        """
        if end <= start:
            return 0.0
        c, plan = self.cfg, self._plan
        head = 2.0 * c.hidden_size * c.vocab_size
        if not c.is_v41 or decoder_every_row or plan.decoder_start is None:
            return self._layers_flops(0, start, end) + head
        tail = max(start, end - c.sliding_window)
        shared_kv = self._shared_kv_flops * (tail - start)
        return self._layers_flops(1, start, end) + shared_kv + self._layers_flops(2, tail, end) + head

    def replay_flops(self, start: int, end: int) -> float:
        """FLOPs to recompute the window state of positions ``[start, end)``: every layer, no LM head."""
        if end <= start:
            return 0.0
        return self._layers_flops(0, start, end)
