"""Statistics of a read trace: its size, lengths, and the hit ratio of a cache that never forgets, counted
the several ways papers report it. Knows nothing of models or caches beyond contiguous-prefix matching of
chained ``hash_ids`` (`kvdiet.sim.traces`).
"""

from __future__ import annotations

from kvdiet.sim.traces import Trace

__all__ = [
    "hit_ratio_variants",
    "infinite_cache_hit_ratio",
    "past_context_notes",
    "trace_notes",
    "trace_stats",
]


def infinite_cache_hit_ratio(trace: Trace) -> float:
    """Share of all ``hash_ids`` blocks found by contiguous-prefix matching in a cache that never forgets:
    each request hits its leading blocks up to the first one no earlier request had (chained ids make
    "seen before" mean "same prefix"). Every request counts ``ceil(input_tokens / block_size)`` blocks: one
    without ``hash_ids`` misses them all, and an agentic session's partial last block, which its file names
    no id for (`kvdiet.sim.agentic`), is a miss, as a JSONL trace's is (`hit_ratio_variants`' ``blocks``)."""
    seen: set[int] = set()
    hits = total = 0
    for r in trace.requests:
        total += -(-r.input_tokens // trace.block_size)
        if r.hash_ids is None:
            continue
        matching = True
        for h in r.hash_ids:
            if matching and h in seen:
                hits += 1
            else:
                matching = False
            seen.add(h)
    return hits / total if total else 0.0


def hit_ratio_variants(trace: Trace) -> dict[str, float]:
    """The infinite-cache hit ratio counted four ways (papers rarely say which they report):

    - ``blocks``: hit blocks / all blocks (`infinite_cache_hit_ratio`);
    - ``tokens``: hit tokens / prompt tokens (a hit partial last block counts its tokens);
    - ``full_blocks``: hit blocks / full blocks (partial last blocks left out of both);
    - ``mean_per_request``: the mean of hit tokens / prompt tokens over the requests with a prompt (an empty
      one has no ratio: counted as 0 it would pull the mean down by its share of requests).
    Contiguous-prefix matching as in `infinite_cache_hit_ratio`; requests without ids hit nothing.
    """
    seen: set[int] = set()
    bs = trace.block_size
    hit_blocks = blocks = hit_tokens = tokens = hit_full = full = 0
    per_request = 0.0
    for r in trace.requests:
        n = r.input_tokens
        ids = r.hash_ids if r.hash_ids is not None else ()
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        seen.update(ids)
        nblocks = -(-n // bs)
        hit = min(k * bs, n)
        hit_blocks, blocks = hit_blocks + k, blocks + nblocks
        hit_tokens, tokens = hit_tokens + hit, tokens + n
        hit_full, full = hit_full + min(k, n // bs), full + n // bs
        per_request += hit / n if n else 0.0
    reqs = sum(1 for r in trace.requests if r.input_tokens)
    return {
        "blocks": round(hit_blocks / blocks, 4) if blocks else 0.0,
        "tokens": round(hit_tokens / tokens, 4) if tokens else 0.0,
        "full_blocks": round(hit_full / full, 4) if full else 0.0,
        "mean_per_request": round(per_request / reqs, 4) if reqs else 0.0,
    }


def trace_stats(trace: Trace) -> dict[str, object]:
    """Summary of a trace: requests, duration (s), prompt and output tokens (total, mean, p50, p99),
    blocks, the infinite-cache block hit ratio, skipped lines, requests that arrived out of order, requests with an
    empty prompt (``input_length`` 0), and whether the file named partial last blocks (``hash_ids_per``:
    ``"block"``, ``"full block"`` or ``"n/a"`` when no request had a partial block)."""
    reqs = trace.requests
    inputs = sorted(r.input_tokens for r in reqs)
    outputs = sorted(r.output_tokens for r in reqs)

    def pct(values: list[int], q: float) -> int:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0

    return {
        "requests": len(reqs),
        "duration_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 3) if reqs else 0.0,
        "block_size": trace.block_size,
        "has_prefix_ids": any(r.hash_ids is not None for r in reqs),
        "input_tokens": {
            "total": sum(inputs),
            "mean": round(sum(inputs) / len(inputs), 1) if inputs else 0.0,
            "p50": pct(inputs, 0.5),
            "p99": pct(inputs, 0.99),
        },
        "output_tokens": {
            "total": sum(outputs),
            "mean": round(sum(outputs) / len(outputs), 1) if outputs else 0.0,
            "p50": pct(outputs, 0.5),
            "p99": pct(outputs, 0.99),
        },
        "blocks": sum(-(-r.input_tokens // trace.block_size) for r in reqs),
        "infinite_cache_block_hit_ratio": round(infinite_cache_hit_ratio(trace), 4),
        "infinite_cache_hit_ratio_variants": hit_ratio_variants(trace),
        "skipped_lines": len(trace.errors),
        "out_of_order_requests": trace.out_of_order,
        "empty_prompts": _empty_prompts(trace),
        "hash_ids_per": {None: "n/a", False: "block", True: "full block"}[trace.full_blocks_only],
    }


def trace_notes(trace: Trace) -> list[str]:
    """What `kvdiet replay` says on stderr about a read trace, one line each: its first ten skipped lines (and how
    many more), timestamps that go backwards (re-sorted), and requests with an empty prompt (simulated as
    requests that read and store no prompt blocks)."""
    notes = [f"skipped {line}" for line in trace.errors[:10]]
    if len(trace.errors) > 10:
        notes.append(f"skipped {len(trace.errors) - 10} more lines")
    if trace.out_of_order:
        notes.append(
            f"warning: timestamps go backwards: {trace.out_of_order:,} of {len(trace):,} requests arrive before one "
            "read earlier (a line above, or an earlier entry of its session's list); re-sorted by arrival (--strict "
            "refuses)"
        )
    if empty := _empty_prompts(trace):
        notes.append(
            f"warning: {empty:,} of {len(trace):,} requests have an empty prompt (input_length 0): simulated as "
            "requests that read and store no prompt blocks; the per-request mean hit ratio leaves them out"
        )
    return notes


def past_context_notes(trace: Trace, limits: dict[str, int]) -> list[str]:
    """One warning per model whose ``max_position_embeddings`` (``limits``) some requests' prompt and output pass
    (the study simulates them all the same, as `kvdiet plan` extrapolates such contexts)."""
    lengths = [r.input_tokens + r.output_tokens for r in trace.requests]
    return [
        f"warning: {len(past):,} of {len(lengths):,} requests (the longest {max(past):,} tokens, prompt and "
        f"output) run past {model}'s max_position_embeddings {limit:,}: simulated all the same, the bytes "
        "extrapolated; the model serves no context that long"
        for model, limit in limits.items()
        if (past := [n for n in lengths if n > limit])
    ]


def _empty_prompts(trace: Trace) -> int:
    """Requests with ``input_length`` 0."""
    return sum(1 for r in trace.requests if r.input_tokens == 0)
