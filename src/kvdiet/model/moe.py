"""The V4.1 mixture-of-experts FFN: a sqrt-softplus router with a selection-only bias, SwiGLU experts with
the swiglu clamp, and one always-on shared expert (v41-spec §8.2, §8.2a; DeepSeek's reference ``Gate``,
``Expert`` and ``MoE``).

Everything runs in fp32 (fp64 in a model converted to fp64); a linear whose weight is stored FP8 or FP4
(the released checkpoint's shared and routed experts) quantises its input to FP8 first
(`kvdiet.model.linear`). Routed experts come from
``experts`` or, when the loader reads them on first use, from ``routed`` (`kvdiet.model.expert_cache`).
Tokens are grouped per expert (one matmul per used expert, no per-token loop); a lone row (a one-request
decode step) skips the sorting into groups, each of its experts being a group of that one row. On the CPU a
decode step's groups (at most 16 rows each) and the shared expert run in one compiled call (`run_experts`:
``expert_rows`` of ``formats/expert_kernels.cpp``, every w1 and w3, the activation, then every w2; without the
compiled kernels two calls of `kvdiet.model.gemv.row_products_each`), the values each `Expert` would give.
Otherwise (off the CPU, or more rows than that) in a batched decode step, when the groups are small and even (a
few rows per expert) and every routed expert is a dense resident `Expert`, all groups run as one batched matmul
per weight over the experts' weights stacked, each group padded to the largest. This module has no effect on
the KV cache and knows nothing of image tokens (``bias_vl`` is not modelled).

V4-Flash's first ``num_hash_layers`` MoE layers are hash-routed: the experts of token id v are the fixed row
``tid2eid[v]`` (a checkpoint buffer [vocab, k]) instead of the router's top-k; the router's scores still
weigh them (transformers ``DeepseekV4HashRouter``; V4 reference ``Gate`` with ``hash``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats import native
from kvdiet.model import gemv
from kvdiet.model.expert_buffers import run_sorted_groups
from kvdiet.model.expert_cache import LayerExperts
from kvdiet.model.fused_rows import expert_groups
from kvdiet.model.layers import as_dtype, constant, widen
from kvdiet.model.linear import Linear
from kvdiet.model.member import member, stands_in

__all__ = ["Expert", "Gate", "MoE", "run_experts"]

_INIT_STD = 0.02  # config ``initializer_range``
# The padded path (where decode rows cannot go to `run_experts`) runs when its padded rows (experts × largest
# group) are at most this many times the (token, slot) pairs — at most 4x the grouped path's multiply-adds, in
# 3 matmuls instead of 3 per expert (fewer kernel launches) — and when one weight of all the experts stacked
# has at most `_STACK_ELEMENTS` elements (stacked on each call).
_PADDING = 4
_STACK_ELEMENTS = 1 << 22


@stands_in
class Gate(nn.Module):
    """The router: ``weight`` fp32 [n_routed_experts, hidden], and ``bias`` fp32 [n_routed_experts] (top-k
    routing) or ``tid2eid`` int64 [hash_vocab, k] (hash routing).

    Scores are ``sqrt(softplus(x·Wᵀ))`` (config ``scoring_func`` ``sqrtsoftplus``). Experts are chosen by the
    top-k of ``scores + bias`` (the bias only selects), or are ``tid2eid[token id]`` when hash-routed.
    Routing weights are the chosen raw scores, divided by (their sum + 1e−20) when ``norm_topk_prob`` and
    k > 1, times ``routed_scaling_factor``.
    """

    def __init__(
        self,
        hidden: int,
        n_experts: int,
        topk: int,
        *,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        hash_vocab: int | None = None,
    ) -> None:
        super().__init__()
        self.topk, self.norm_topk_prob = topk, norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, hidden, dtype=torch.float32))
        if hash_vocab is None:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
            self.register_buffer("tid2eid", None)
        else:
            self.bias = None
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, topk, dtype=torch.int64))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=_INIT_STD)

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden]; token_ids: int64 [T] (hash routing only) -> (weights [T, k] in x's compute dtype,
        expert ids int64 [T, k]).

        Ties in ``scores + bias`` go to the lowest expert index (a stable descending sort), so the choice
        never depends on ``torch.topk``'s unspecified tie order or on the thread count. A decode step's rows
        (`kvdiet.model.gemv.applies`: 1..16 fp32 rows on the CPU, no autograd) of a top-k router run in one
        compiled call (``route_rows``, ``formats/router_kernels.cpp``), with the same bits (ids contiguous).

        Raises:
            ValueError: a hash-routed gate without ``token_ids``, or a ``tid2eid`` row naming no expert.
        """
        x = widen(x)
        # `member`: the parameters' and buffers' own dicts (nn.Module's attribute fallback: a microsecond a lookup)
        weight, bias, tid2eid = member(self, "weight"), member(self, "bias"), member(self, "tid2eid")
        if tid2eid is None and not torch.is_grad_enabled() and gemv.applies(x, weight):
            kernels = native.fp4_kernels()
            routed = None if kernels is None else kernels.route_rows(
                x, weight, bias, self.topk, self.norm_topk_prob, self.routed_scaling_factor
            )  # fmt: skip
            if routed is not None:
                return routed
        dt = x.dtype
        scores = torch.sqrt(F.softplus(x @ as_dtype(weight, dt).T))  # [T, E]
        if tid2eid is not None:
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer needs the token ids")
            ids = tid2eid[token_ids]
            if bool(((ids < 0) | (ids >= scores.shape[1])).any()):
                raise ValueError(f"tid2eid names an expert outside [0, {scores.shape[1]})")
        else:
            order = torch.sort(scores + as_dtype(bias, dt), dim=-1, descending=True, stable=True).indices
            ids = order[:, : self.topk]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / weights.sum(-1, keepdim=True).add_(constant(1e-20, dt))
        return weights * constant(self.routed_scaling_factor, dt), ids


class Expert(nn.Module):
    """SwiGLU expert: ``y = w2 · (weight · silu(gate) · up)``, ``gate = w1·x``, ``up = w3·x`` in fp32.

    With ``swiglu_limit`` L > 0, ``up`` is clamped to [−L, L] and ``gate`` to (−∞, L] before the product
    (config ``swiglu_limit``, 10 for V4.1). Linears have no bias: ``w1``/``w3`` [inter, hidden], ``w2``
    [hidden, inter].
    """

    def __init__(self, hidden: int, inter: int, *, swiglu_limit: float) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1, self.w2, self.w3 = Linear(hidden, inter), Linear(inter, hidden), Linear(hidden, inter)
        for lin in (self.w1, self.w2, self.w3):
            if lin.weight.device.type != "meta":
                nn.init.normal_(lin.weight, std=_INIT_STD)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x: [N, hidden]; weight: [N, 1] routing weights or None (shared expert) -> [N, hidden], fp32 (fp64
        in a model run in fp64)."""
        x = widen(x)
        return self.w2(self.activation(self.w1(x), self.w3(x), weight))

    def activation(self, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``weight · silu(gate) · up`` after the swiglu clamp: the input of ``w2``. gate, up: [N, inter];
        weight: [N, 1] or None -> [N, inter]."""
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        act = F.silu(gate) * up
        return act if weight is None else weight * act

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(w1, w3, w2)`` weights when all three are stored dense, else None."""
        # the submodules' own dict and `member`: nn.Module's attribute fallback costs about a microsecond a
        # lookup, and a decode step asks for every used expert's weights in every layer
        mods = self._modules
        w1, w3, w2 = mods["w1"], mods["w3"], mods["w2"]
        if w1.storage != "dense" or w3.storage != "dense" or w2.storage != "dense":
            return None
        return member(w1, "weight"), member(w3, "weight"), member(w2, "weight")


def _fits(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``expert_rows`` takes routing weights ``weight`` for rows ``x`` as they are: fp32 [M, 1] on the CPU
    (other dtypes or shapes would promote or broadcast differently in torch's ``weight * act``)."""
    return weight.dtype == torch.float32 and weight.is_cpu and tuple(weight.shape) == (x.shape[0], 1)


def run_experts(
    experts: Sequence[Expert], xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``experts[i](xs[i], weights[i])`` for every i, bit for bit, when every expert is dense and the rows fit
    (`gemv.applies`): a decode step's few rows per expert in one compiled call (``expert_rows``: the
    products of `kvdiet.model.gemv.row_products_each`, the activation as torch's own ops called from C++), or,
    without the compiled kernels or for routing weights of another dtype or shape, two calls of
    `gemv.row_products_each` (every w1 and w3, then every w2) around `Expert.activation`. Otherwise (or when a
    routing weight requires grad under grad mode: the products keep no autograd graph) each expert's own
    forward.

    xs[i]: [N_i, hidden]; weights[i]: [N_i, 1] or None -> [N_i, hidden] each.
    """
    xs = [widen(x) for x in xs]
    dense = [e.dense_weights() for e in experts]
    fit = all(d is not None and gemv.applies_all(x, d) for d, x in zip(dense, xs, strict=True))
    tracked = torch.is_grad_enabled() and any(w is not None and w.requires_grad for w in weights)
    if not fit or tracked:  # the products keep no autograd graph: a routing weight's gradient needs F.linear
        return [e(x, w) for e, x, w in zip(experts, xs, weights, strict=True)]
    kernels = native.fp4_kernels()
    if kernels is not None and all(w is None or _fits(w, x) for w, x in zip(weights, xs, strict=True)):
        return kernels.expert_rows(
            xs, *([d[j] for d in dense] for j in range(3)), list(weights), [e.swiglu_limit for e in experts]
        )
    gate_up = gemv.row_products_each(
        [x for x in xs for _ in range(2)], [w for d in dense for w in d[:2]], checked=False
    )
    acts = [
        e.activation(gate_up[2 * i], gate_up[2 * i + 1], w)
        for i, (e, w) in enumerate(zip(experts, weights, strict=True))
    ]
    return gemv.row_products_each(acts, [d[2] for d in dense], checked=False)


@stands_in
class MoE(nn.Module):
    """Routed experts plus shared experts; output = Σ routed (weighted) + shared (v41-spec §8.2a).

    Submodules (checkpoint names under ``layers.{i}.ffn.``): ``gate`` (`Gate`), ``experts`` (ModuleList of
    ``n_routed_experts`` `Expert` of ``moe_intermediate_size``), ``shared_experts`` (one `Expert` of
    ``n_shared_experts · moe_intermediate_size``, weight 1).

    Args:
        cfg: the model config.
        hash_routed: route by ``gate.tid2eid`` (V4-Flash's first ``num_hash_layers`` layers).
    Raises:
        ValueError: ``scoring_func`` is not ``sqrtsoftplus`` or ``n_shared_experts`` < 1.
    """

    def __init__(self, cfg: ModelConfig, *, hash_routed: bool = False) -> None:
        super().__init__()
        if cfg.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {cfg.scoring_func!r} is not supported (only 'sqrtsoftplus')")
        if cfg.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts must be >= 1, got {cfg.n_shared_experts}")
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.n_routed_experts = cfg.n_routed_experts
        self.gate = Gate(
            hidden,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            hash_vocab=cfg.vocab_size if hash_routed else None,
        )
        self.experts = nn.ModuleList(
            Expert(hidden, inter, swiglu_limit=cfg.swiglu_limit) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(hidden, cfg.n_shared_experts * inter, swiglu_limit=cfg.swiglu_limit)
        # Set by the loader when routed experts are read on first use (``kvdiet.model.expert_cache``).
        self.routed: LayerExperts | None = None

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None, *, padded: bool = False
    ) -> torch.Tensor:
        """x: [T, hidden] (any float dtype); token_ids: int64 [T], needed by a hash-routed layer -> [T, hidden],
        fp32 (fp64 in a model run in fp64).

        ``padded``: the rows are a batched decode step's (one per request): where `run_experts` cannot take
        them as decode rows (off the CPU, more than 16 rows), small even groups may run as one padded batched
        matmul (`_routed_padded`), whose rows may round differently from the per-expert loop (fp32
        reassociation). Otherwise (a prefill, a lone request) every group runs on its own.

        Raises:
            ValueError: see `Gate.forward`.
        """
        x = widen(x)
        weights, ids = self._modules["gate"](x, token_ids)  # [T, k] each
        if ids.shape[0] == 1:
            id_list = ids.tolist()[0]  # no ``ids[0]`` view to dispatch
            if len(set(id_list)) == len(id_list):
                return self._one_row(x, weights, ids, id_list)
        return self._routed_grouped(x, weights, ids, padded=padded)

    def fetch(self, ids: list[int]) -> list[Expert]:
        """Experts ``ids`` (each in [0, n_routed_experts)), each fetched once: a lazily read one is loaded here;
        resident ones straight from the ModuleList's own dict (its ``__getitem__`` costs about a microsecond)."""
        if self.routed is not None:
            return [self.routed[e] for e in ids]
        mods = self._modules["experts"]._modules
        return [mods[str(e)] for e in ids]

    def _one_row(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, id_list: list[int] | None = None
    ) -> torch.Tensor:
        """The FFN of one row whose k experts all differ (a decode step of one request): each expert's group is
        that row, so `_routed_grouped`'s products and k-slot sum without the sorting into groups; the shared
        expert runs with the routed ones (`run_experts`).

        x: [1, hidden]; weights [1, k]; ids int64 [1, k] (``id_list``: its row as a list, when the caller has it)
        -> [1, hidden] in x's dtype.
        """
        id_list = ids[0].tolist() if id_list is None else id_list
        k = len(id_list)
        chosen = self.fetch(id_list)
        by_id = dict(zip(id_list, chosen, strict=True))
        used = sorted(by_id)
        shared_expert = self._modules["shared_experts"]
        row = expert_groups(x, weights, ids, used, [by_id[e] for e in used], shared_expert)
        if row is not None:
            return row
        slots = weights.split(1, dim=1)  # k views [1, 1], as weights[:, j : j + 1], in one call
        *routed, shared = run_experts([*chosen, shared_expert], [x] * (k + 1), [*slots, None])
        routed = torch.cat([as_dtype(out, x.dtype) for out in routed]).view(1, k, -1).sum(1)
        return routed + shared

    def _routed_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *, padded: bool = False
    ) -> torch.Tensor:
        """Σ over the k slots of weight · expert(row) + the shared expert, rows grouped per expert (`run_experts`
        over the used experts' groups; with ``padded``, `_routed_padded` when its products are not run as decode
        rows, the groups are small and even and the experts stack).

        x: [T, hidden]; weights [T, k]; ids int64 [T, k] -> [T, hidden] in x's dtype.
        """
        num_tokens, k = ids.shape
        flat_ids = ids.flatten()  # (token, slot) pairs, token-major
        counts = torch.bincount(flat_ids, minlength=self.n_routed_experts).tolist()
        decode_rows = max(counts) <= gemv.ROWS_MAX and num_tokens <= gemv.ROWS_MAX and x.device.type == "cpu"
        if padded and not decode_rows and self.n_routed_experts * max(counts) <= _PADDING * flat_ids.numel():
            stacked = self._stacked_weights(x.dtype)
            if stacked is not None:
                order = torch.argsort(flat_ids, stable=True)
                return self._routed_padded(x, weights, order, counts, stacked) + self.shared_experts(x)
        used_ids = [e for e, n in enumerate(counts) if n]
        used = self.fetch(used_ids)
        if decode_rows:
            grouped = expert_groups(x, weights, ids, used_ids, used, self.shared_experts)
            if grouped is not None:
                return grouped
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
        tokens = torch.floor_divide(order, k)  # what ``order // k`` calls, without its Python wrapper
        # gathers as index_select (4x faster than advanced indexing on the CPU; the same copies)
        sorted_weights = weights.flatten().index_select(0, order)[:, None]
        sizes = [counts[e] for e in used_ids]  # a prefill's groups: shared buffers, fewer calls
        sorted_out = None if decode_rows else run_sorted_groups(x, tokens, sorted_weights, sizes, used)
        if sorted_out is None:
            rows, slots, start = [], [], 0
            for e in used_ids:
                part = slice(start, start + counts[e])
                rows.append(x.index_select(0, tokens[part]))
                slots.append(sorted_weights[part])
                start += counts[e]
            *outs, shared = run_experts([*used, self.shared_experts], [*rows, x], [*slots, None])
            sorted_out = torch.cat([as_dtype(out, x.dtype) for out in outs])
        else:
            shared = self.shared_experts(x)
        # back to (token, slot) order by order's inverse (scattered, not sorted), then sum the k slots in order
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        routed = sorted_out.index_select(0, back).view(num_tokens, k, -1).sum(1)
        return routed + shared

    def _stacked_weights(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], float] | None:
        """``([w1, w3, w2], swiglu_limit)``: the routed experts' weights stacked as ``[E, in, out]`` (transposed
        views of a copy) and their clamp; None when an expert is read on first use, stored quantised, of
        another dtype or clamp, or the stack would exceed `_STACK_ELEMENTS`."""
        if self.routed is not None:
            return None
        experts = list(self.experts)
        limit, weights = experts[0].swiglu_limit, []  # w1, w3, w2 of expert 0, then of expert 1, ...
        for e in experts:
            linears = (e.w1, e.w3, e.w2)
            if e.swiglu_limit != limit or any(lin.storage != "dense" for lin in linears):
                return None
            weights += [lin.weight for lin in linears]
        too_big = max(w.numel() for w in weights[:3]) * len(experts) > _STACK_ELEMENTS
        if too_big or any(w.dtype != dtype for w in weights):
            return None
        return [torch.stack(weights[j::3]).transpose(1, 2) for j in range(3)], limit

    def _routed_padded(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        order: torch.Tensor,
        counts: list[int],
        stacked: tuple[list[torch.Tensor], float],
    ) -> torch.Tensor:
        """`_routed_grouped` with every group padded to the largest and the experts' weights stacked: one
        batched matmul per weight. ``order`` int64 [T·k]: the (token, slot) pairs (token-major) sorted by
        expert, stable; ``counts`` the pairs per expert; ``stacked`` from `_stacked_weights`.

        Each group's rows get what `Expert.forward` gives them, by the same ops, except that a matmul row may
        round differently with the number of rows it is computed among (fp32 reassociation: on the CPU, a
        group of fewer than 4 rows padded to 4 or more).
        """
        num_tokens, k = weights.shape
        n_exp, width, dev = len(counts), max(counts), x.device
        # the sorted pairs' padded rows: group e holds rows [e·width, e·width + counts[e])
        at = torch.tensor([e * width + r for e, n in enumerate(counts) for r in range(n)], device=dev)
        rows = torch.zeros(n_exp * width, dtype=torch.int64, device=dev).index_put_((at,), order // k)
        scale = torch.zeros(n_exp * width, dtype=x.dtype, device=dev)
        scale.index_put_((at,), weights.flatten().index_select(0, order))
        (w1, w3, w2), limit = stacked
        xp = x.index_select(0, rows).view(n_exp, width, -1)
        gate, up = torch.bmm(xp, w1), torch.bmm(xp, w3)
        if limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        act = scale.view(n_exp, width, 1) * (F.silu(gate) * up)
        out = torch.bmm(act, w2).view(n_exp * width, -1)
        # back to (token, slot) order with a gather, then sum the k slots in slot order
        pair_rows = torch.empty_like(at).index_put_((order,), at)
        return out.index_select(0, pair_rows).view(num_tokens, k, -1).sum(1)
