"""Engine-mode trace replay: a trace slice through the real kvdiet engine, prompts made from the hash ids.

A trace gives lengths and prefix-block ids, not text. `scale_trace` shrinks every trace block to
``block_size`` engine tokens (prompt and output lengths scale with it, at least one token each) so a slice
runs in minutes on a CPU; `prompt_ids` then turns each request's ids into token ids deterministically:
block i with id h is ``block_size`` tokens drawn from a generator seeded with ``(seed, h, i)``, so the same
id at the same position always gives the same tokens and different ids give different tokens (a partial
last block is the first tokens of its block). Requests without ids (Azure) get ids of their own, and so do
the blocks past a request's ids (the partial last block of a trace with one id per full block).

The engine (`kvdiet.engine.LLMEngine`, default ``v4.1-mini``; ``v4-mini`` runs V4-Flash, whose blocks are
multiples of 128 tokens) runs with its block size equal to the scaled block, its tiers (device pool, a
persistent tier in a temporary directory unless one is given, the SWA pool, and the global pool when
``cache.global_pool`` names a Mooncake master: the model-free run then has a global tier of the same TTL whose
capacity does not bind) on a manual clock in trace time: each request's lookups and stores happen at its trace
arrival.

- ``time_scale = 0`` (default): one request at a time, each submitted when the previous finished (requests
  sharing a timestamp are spaced `SEQUENTIAL_GAP_S` apart in trace time) — the deterministic mode, whose
  hit/miss sequence equals the model-free simulation of the same scaled trace while capacities do not bind
  (`run_engine_mode` reports how many requests agree).
- ``time_scale > 0``: request i is submitted ``arrival_s × time_scale`` wall seconds after the start
  and requests overlap as the scheduler batches them; the clock follows the trace time of the wall clock.

TTFT is measured: wall seconds from submission to the first output token. Bytes are measured too: what the
engine wrote to each tier (payloads with their entry headers), beside the model-free run's counts for the
same slice (payload bytes from the byte geometry).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvdiet.cache.plan import Provenance
from kvdiet.engine.engine import LLMEngine
from kvdiet.engine.max_model_len import check_max_model_len
from kvdiet.engine.runner import CacheOptions, ModelRunner
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import SchedulerConfig
from kvdiet.model.build import load_model
from kvdiet.setting_error import SettingError
from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.traces import Trace, TraceRequest
from kvdiet.storage.clock import ManualClock

__all__ = ["EngineModeConfig", "EngineModeResult", "prompt_ids", "run_engine_mode", "scale_trace"]

_MASK = (1 << 64) - 1
FIRST_TOKEN_ID = 1000
"""Synthesized prompts use ids from here to the vocabulary's end (clear of special and control tokens)."""


def scale_trace(trace: Trace, block_size: int) -> Trace:
    """``trace`` with each block of ``trace.block_size`` tokens shrunk to ``block_size`` tokens.

    A prompt of q full blocks and r leftover tokens becomes ``q × block_size + ceil(r × block_size /
    trace.block_size)`` tokens; an output of m tokens ``max(1, ceil(m × block_size / trace.block_size))``.
    Hash ids, arrival times and the other fields are kept (``len(hash_ids)`` is ``ceil(input / block_size)``
    again for ids that name the partial block; with one id per full block, a last block that shrinks to a
    full one has no id).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    big = trace.block_size

    def shrink(tokens: int) -> int:
        q, r = divmod(tokens, big)
        return q * block_size + -(-r * block_size // big)

    reqs = [
        replace(r, input_tokens=max(1, shrink(r.input_tokens)), output_tokens=max(1, shrink(r.output_tokens)))
        for r in trace.requests
    ]
    return Trace(reqs, block_size, list(trace.errors))


def prompt_ids(
    request: TraceRequest, index: int, block_size: int, vocab_size: int, seed: int = 0
) -> list[int]:
    """Token ids of ``request`` (see the module docstring); ``index`` names its blocks that have no id (all of
    them without ``hash_ids``; those past the last id with one id per full block).

    Raises:
        ValueError: the vocabulary leaves no room above `FIRST_TOKEN_ID` (or 4 for tiny test models).
    """
    first = FIRST_TOKEN_ID if vocab_size > 2 * FIRST_TOKEN_ID else 4
    if vocab_size <= first:
        raise ValueError(f"vocabulary of {vocab_size} ids is too small to synthesize prompts")
    n = request.input_tokens
    blocks = -(-n // block_size)
    named = request.hash_ids if request.hash_ids is not None else ()
    ids = [*named[:blocks], *[-(index + 1)] * (blocks - len(named))]
    out: list[int] = []
    for i in range(blocks):
        rng = np.random.Generator(np.random.PCG64([seed & _MASK, int(ids[i]) & _MASK, i]))
        out += rng.integers(first, vocab_size, size=block_size).tolist()
    return out[:n]


@dataclass(frozen=True)
class EngineModeConfig:
    """An engine-mode run.

    Attributes:
        model: V4.1 or V4-Flash preset or config the engine loads (seeded random weights).
        block_size: engine tokens per trace block (and the engine's block size).
        max_requests: requests taken from the trace's start.
        time_scale: wall seconds per trace second (0: one request at a time).
        cache: the engine's cache options (block size and, when None, the persistent dir are set here).
        max_num_seqs / max_num_batched_tokens: scheduler limits.
        seed: weights and prompt synthesis seed.
        device: where the model runs (``cpu``, ``cuda``, ``cuda:N``; `kvdiet.device`).
    """

    model: str = "v4.1-mini"
    block_size: int = 16
    max_requests: int = 8
    time_scale: float = 0.0
    cache: CacheOptions = field(default_factory=CacheOptions)
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 512
    seed: int = 0
    device: str = "cpu"


@dataclass
class EngineModeResult:
    """Per-request results of an engine-mode run, its TTFTs, and the model-free run it is compared with.

    Attributes:
        written: bytes and entries the engine wrote: ``persistent_bytes_written``,
            ``persistent_entries_written``, ``swa_pool_bytes_written``, ``snapshots_stored`` (and
            ``global_pool_bytes_written`` with a global pool).
        model_free_summary: the model-free run's summary (`kvdiet.sim.model_free.simulate`).
    """

    config: EngineModeConfig
    trace: Trace
    requests: list[Provenance]
    ttft_s: list[float]
    wall_s: float
    model_free: list[Provenance]
    written: dict[str, int] = field(default_factory=dict)
    model_free_summary: dict[str, object] = field(default_factory=dict)

    @property
    def agreeing(self) -> int:
        """Requests whose hit, window source and replay equal the model-free simulation's."""
        return sum(a == b for a, b in zip(self.requests, self.model_free, strict=True))

    def summary(self) -> dict[str, object]:
        ttft = sorted(self.ttft_s)
        prompt = sum(r.input_tokens for r in self.trace.requests) or 1

        def pct(
            q: float,
        ) -> float | None:  # nearest rank: the smallest value with at least q of them at or below
            return round(ttft[max(0, math.ceil(q * len(ttft)) - 1)], 4) if ttft else None

        sources: dict[str, int] = {}
        for r in self.requests:
            sources[r.window_source] = sources.get(r.window_source, 0) + 1
        return {
            "model": self.config.model,
            "policy": str(self.config.cache.policy),
            "requests": len(self.requests),
            "block_size": self.config.block_size,
            "time_scale": self.config.time_scale,
            "prompt_tokens": sum(r.input_tokens for r in self.trace.requests),
            "device_hit_ratio": round(sum(r.device_tokens for r in self.requests) / prompt, 6),
            "persistent_hit_ratio": round(sum(r.persistent_tokens for r in self.requests) / prompt, 6),
            **(
                {"global_pool_hit_ratio": round(sum(r.global_pool_tokens for r in self.requests) / prompt, 6)}
                if self.config.cache.global_pool is not None
                else {}
            ),
            "window_sources": sources,
            "replayed_tokens": sum(r.replayed_tokens for r in self.requests),
            "computed_tokens": sum(r.computed_tokens for r in self.requests),
            "ttft_p50_s": pct(0.5),
            "ttft_p90_s": pct(0.9),
            "ttft_max_s": round(ttft[-1], 4) if ttft else None,
            "wall_s": round(self.wall_s, 3),
            "model_free_agreeing": self.agreeing,
            **self.written,
            **{
                f"model_free_{k}": self.model_free_summary.get(k)
                for k in ("persistent_bytes_written", "swa_pool_bytes_written", "snapshots_stored")
            },
        }


def run_engine_mode(
    trace: Trace, config: EngineModeConfig, *, progress: Callable[[int], None] | None = None
) -> EngineModeResult:
    """Run the first ``max_requests`` requests of ``trace`` through the engine (module docstring).

    Raises:
        ValueError: ``max_requests`` < 1, a negative ``time_scale``, an empty trace, or a bad model/cache
            setting (before any request runs).
    """
    if config.max_requests < 1 or config.time_scale < 0:
        raise ValueError("max_requests must be >= 1 and time_scale >= 0")
    if not trace.requests:
        raise ValueError("the trace has no requests")
    scaled = scale_trace(Trace(trace.requests[: config.max_requests], trace.block_size), config.block_size)
    if config.time_scale == 0:
        scaled = _one_after_another(scaled)
    with tempfile.TemporaryDirectory(prefix="kvdiet-replay-") as tmp:
        opts = replace(
            config.cache,
            block_size=config.block_size,
            persistent_dir=config.cache.persistent_dir if config.cache.persistent_dir is not None else tmp,
        )
        model, tokenizer = load_model(config.model, seed=config.seed, device=config.device)
        clock = ManualClock(scaled.requests[0].arrival_s)
        cache = ModelRunner(
            model, opts, tokenizer_id=tokenizer.identity if tokenizer else "none", clock=clock
        )
        opts = cache.options  # a policy left None: the model's (`CacheOptions.for_model`)
        longest = max(r.input_tokens + r.output_tokens for r in scaled.requests)
        # before any tier opens
        _check_longest(longest, model.cfg.max_position_embeddings, cache, config.model)
        cache.open()
        try:
            engine = LLMEngine(
                model,
                cache,
                tokenizer=tokenizer,
                max_model_len=max(longest, 1),
                scheduler=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            )
            results, ttft, wall = _drive(engine, scaled, config, clock, progress)
            st = cache.stats
            written = {
                "persistent_bytes_written": st.persistent.bytes_written,
                "persistent_entries_written": st.persistent.entries_written,
                "swa_pool_bytes_written": st.swa_pool.bytes_written,
                "snapshots_stored": st.snapshots_stored,
            }
            if opts.global_pool is not None:
                written["global_pool_bytes_written"] = st.global_pool.bytes_written
        finally:
            cache.close()
    sim = simulate(
        scaled,
        SimConfig(
            model=config.model,
            policy=opts.policy,
            device_bytes=opts.kv_cache_memory,
            persistent_bytes=opts.persistent_size,
            persistent_ttl_s=opts.persistent_ttl_s,
            swa_pool_bytes=opts.swa_pool_size or 10**15,
            swa_pool_ttl_s=opts.swa_pool_ttl_s,
            global_pool_bytes=0
            if opts.global_pool is None
            else 10**15,  # the master's capacity: not modelled
            global_pool_ttl_s=opts.global_pool_ttl_s,
            prefix_caching=opts.prefix_caching,
            output_tok_s=1e12,
        ),
    )
    config = replace(config, cache=replace(config.cache, policy=opts.policy))  # the policy that ran
    return EngineModeResult(config, scaled, results, ttft, wall, sim.requests, written, sim.summary)


def _check_longest(longest: int, limit: int, cache: ModelRunner, model: str) -> None:
    """The engine's context (its ``max_model_len``) is the longest replayed request: the engine's own check
    (`kvdiet.engine.max_model_len.check_max_model_len`), run before any tier opens, its refusal told in replay's
    terms (it names a ``--max-model-len`` that replay does not take).

    Args:
        longest: the longest replayed request's prompt + output, in tokens (after `scale_trace`).
        limit: the model's ``max_position_embeddings`` (tokens); cache: its device pool (blocks, bytes a block);
        model: the model's name, for the message.
    Raises:
        ValueError: past ``limit``, or more blocks than the device pool holds.
    """
    bs, pool = cache.options.block_size, cache.pool
    try:
        check_max_model_len(
            longest,
            limit=limit,
            block_size=bs,
            num_blocks=pool.blocks.num_blocks,
            block_bytes=pool.block_bytes,
        )
    except SettingError:
        what = f"the longest replayed request, {longest:,} tokens (prompt + output at block size {bs})"
        if longest > limit:
            raise ValueError(
                f"{what}, is past {model}'s max_position_embeddings {limit:,}: replay a model with a longer "
                "context (--engine-model)"
            ) from None
        need = -(-longest // bs)
        raise ValueError(
            f"{what}, needs {need:,} blocks but the KV cache holds {pool.blocks.num_blocks:,}: raise "
            f"--kv-cache-memory to at least {need * pool.block_bytes:,} bytes"
        ) from None


SEQUENTIAL_GAP_S = 1e-3
"""Sequential mode: requests that share a timestamp are spaced this far apart in trace time, since the engine
runs them one after another (the model-free comparison then sees the same order)."""


def _one_after_another(trace: Trace) -> Trace:
    reqs, last = [], -float("inf")
    for r in trace.requests:
        last = max(r.arrival_s, last + SEQUENTIAL_GAP_S)
        reqs.append(replace(r, arrival_s=last))
    return Trace(reqs, trace.block_size, list(trace.errors))


def _drive(engine: LLMEngine, trace: Trace, config: EngineModeConfig, clock: ManualClock, progress):
    vocab = engine.model.cfg.vocab_size
    prompts = [prompt_ids(r, i, trace.block_size, vocab, config.seed) for i, r in enumerate(trace.requests)]
    params = [
        SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True, seed=config.seed)
        for r in trace.requests
    ]
    order: dict[str, int] = {}
    results: list[Provenance | None] = [None] * len(prompts)
    ttft: list[float] = [0.0] * len(prompts)
    done = 0
    start = time.perf_counter()
    nxt = 0
    while done < len(prompts):
        if config.time_scale == 0:
            due = nxt < len(prompts) and not engine.has_unfinished
        else:
            elapsed = time.perf_counter() - start
            due = nxt < len(prompts) and elapsed >= trace.requests[nxt].arrival_s * config.time_scale
            clock.set(max(clock.now(), elapsed / config.time_scale))
        if due:
            clock.set(max(clock.now(), trace.requests[nxt].arrival_s))
            order[engine.add_request(prompts[nxt], params[nxt])] = nxt
            nxt += 1
            continue
        if not engine.has_unfinished:
            time.sleep(min(0.05, max(0.0, trace.requests[nxt].arrival_s * config.time_scale - elapsed)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            i = order[out.request_id]
            results[i] = out.provenance
            ttft[i] = out.ttft_s if out.ttft_s is not None else 0.0
            done += 1
            if progress is not None:
                progress(done)
    return results, ttft, time.perf_counter() - start
