"""The continuous-batching engine on v4.1-micro (W = 8, block size 4): batched runs equal solo runs, the
token budget and sequence limit hold, preemption resumes correctly, abort at any point frees every block,
stop conditions, and the input cases B26–B29."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvdiet.cache.policies import parse_policy
from kvdiet.config import load_config
from kvdiet.engine.engine import LLMEngine
from kvdiet.engine.generate import check_request, generate
from kvdiet.engine.prepared import ContextLengthError
from kvdiet.engine.request import RequestOutput
from kvdiet.engine.runner import CacheOptions, ModelRunner
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import ScheduledStep, SchedulerConfig
from kvdiet.model.transformer import Transformer

BS = 4
V = 64

_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ+/"


class LetterTokenizer:
    """One character per id of the micro vocabulary (64 ids); BOS 0, EOS 63."""

    bos_token_id, eos_token_id = 0, 63

    def encode(self, text: str, *, most: int | None = None) -> list[int]:
        return [_ALPHABET.index(c) for c in text]

    def least_tokens(self, text: str, *, enough: int | None = None) -> int:
        return 0  # no bound without tokenizing (`Tokenizer.least_tokens` for short text)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(_ALPHABET[i] for i in ids)


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=3)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 62, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(
    model: Transformer,
    *,
    blocks: int = 300,
    policy: str = "bounded-replay",
    max_num_seqs: int = 4,
    budget: int = 16,
    max_model_len: int | None = 128,
    tokenizer: object | None = None,
) -> LLMEngine:
    opts = CacheOptions(
        kv_cache_memory=blocks * model.new_pool(1, block_size=BS).block_bytes,
        block_size=BS,
        policy=parse_policy(policy),
    )
    cache = ModelRunner(model, opts).open()
    return LLMEngine(
        model,
        cache,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_num_seqs, budget),
    )


def _solo(model: Transformer, ids: list[int], params: SamplingParams) -> list[int]:
    return generate(model, ids, params).output_ids


def _run(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    rids = [engine.add_request(p, params) for p in prompts]
    final: dict[str, RequestOutput] = {}
    engine.run_to_completion(lambda o: final.__setitem__(o.request_id, o) if o.finished else None)
    return [final[r] for r in rids]


def _record_steps(engine: LLMEngine) -> list[tuple[ScheduledStep, int]]:
    """Wrap the scheduler so every plan is kept with the running count after it."""
    steps: list[tuple[ScheduledStep, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> ScheduledStep:
        plan = schedule()
        steps.append((plan, len(engine.scheduler.running)))
        return plan

    engine.scheduler.schedule = recording
    return steps


def _assert_clean(engine: LLMEngine, free_at_start: int) -> None:
    blocks = engine.runner.pool.blocks
    assert blocks.num_free == free_at_start
    assert blocks.num_used == 0
    blocks.check_integrity()
    assert not engine.requests and not engine.has_unfinished


def test_batch_equals_solo_runs_under_a_small_token_budget(micro: Transformer) -> None:
    engine = _engine(micro, max_num_seqs=3, budget=16)
    free = engine.runner.pool.blocks.num_free
    steps = _record_steps(engine)
    prompts = [_ids(n, seed=n) for n in (3, 9, 17, 30, 41)]
    params = SamplingParams(max_tokens=6)
    outs = _run(engine, prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.output_ids) == _solo(micro, p, params)
        assert o.finish_reason == "length" and o.prompt_tokens == len(p)
    assert all(plan.num_tokens <= 16 for plan, _ in steps)
    assert max(running for _, running in steps) == 3  # the sequence limit is reached, never passed
    assert any(plan.prefills and plan.decodes for plan, _ in steps)  # chunked prefill beside decodes
    assert any(n < 16 and n < len(r.prompt_ids) for plan, _ in steps for r, n in plan.prefills)  # chunks
    _assert_clean(engine, free)


@pytest.mark.parametrize("policy", ["bounded-replay", "exact-recompute"])
def test_preemption_resumes_with_the_same_tokens(micro: Transformer, policy: str) -> None:
    # 20 blocks of 4 tokens; four requests of 20 + 20 tokens need 10 blocks each: they must take turns.
    engine = _engine(micro, blocks=20, policy=policy, max_num_seqs=4, budget=32, max_model_len=64)
    free = engine.runner.pool.blocks.num_free
    prompts = [_ids(20, seed=100 + i) for i in range(4)]
    params = SamplingParams(max_tokens=20)
    outs = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.output_ids) == _solo(micro, p, params)
    _assert_clean(engine, free)


def test_preempted_request_reuses_its_cached_prefix(micro: Transformer) -> None:
    # 24 blocks; two requests of 40 + 24 tokens (16 blocks each) fit together only until they decode.
    engine = _engine(micro, blocks=24, max_num_seqs=4, budget=32, max_model_len=64)
    prompts = [_ids(40, seed=200 + i) for i in range(2)]
    params = SamplingParams(max_tokens=24)
    outs = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions == 1 and outs[1].num_preemptions == 1
    # The preempted request looked up prompt + outputs again: its head blocks were still cached (tail-first
    # release leaves the prefix for last) and only the rest was recomputed.
    resumed = 40 + len(outs[1].output_ids)  # at most this many tokens looked up on resumption
    assert (
        engine.runner.stats.device.hit_tokens >= 32
    )  # 8 of its 10 prompt blocks survived the other's decode
    assert engine.runner.stats.computed_tokens <= 2 * 40 + resumed - 32
    assert [list(o.output_ids) for o in outs] == [_solo(micro, p, params) for p in prompts]


@pytest.mark.parametrize("steps", [0, 1, 2, 4, 7])
def test_abort_at_any_point_frees_every_block(micro: Transformer, steps: int) -> None:
    engine = _engine(micro, max_num_seqs=2, budget=8)
    free = engine.runner.pool.blocks.num_free
    rids = [engine.add_request(_ids(n, seed=n), SamplingParams(max_tokens=10)) for n in (5, 13, 22)]
    for _ in range(steps):
        engine.step()
    finals = [engine.abort_request(r) for r in rids]
    assert all(f is not None and f.finished and f.finish_reason == "abort" for f in finals)
    assert engine.abort_request(rids[0]) is None  # a second abort does nothing
    _assert_clean(engine, free)
    p = _ids(11, seed=5)
    (out,) = _run(engine, [p], SamplingParams(max_tokens=4))
    assert list(out.output_ids) == _solo(micro, p, SamplingParams(max_tokens=4))


def test_stop_token_max_tokens_and_scoring_only(micro: Transformer) -> None:
    engine = _engine(micro)
    p = _ids(15, seed=9)
    ref = _solo(micro, p, SamplingParams(max_tokens=8))
    stop = ref[3]
    first = ref.index(stop)
    (out,) = _run(engine, [p], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    assert list(out.output_ids) == ref[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop  # the stop token id (vLLM's stop_reason)
    computed = engine.runner.stats.computed_tokens
    (score,) = _run(engine, [_ids(9, seed=10)], SamplingParams(max_tokens=0))
    assert score.output_ids == () and score.finish_reason == "length" and score.stop_reason is None
    assert engine.runner.stats.computed_tokens == computed + 9  # the prompt was prefilled


def test_stop_strings_cut_the_text_and_never_stream_a_part_of_one(micro: Transformer) -> None:
    tok = LetterTokenizer()
    engine = _engine(micro, tokenizer=tok)
    prompt = "helloworld"
    ids = [tok.bos_token_id, *tok.encode(prompt)]
    ref = _solo(micro, ids, SamplingParams(max_tokens=10))
    ref_text = tok.decode(ref)
    stop = ref_text[4:6]
    cut = ref_text.find(stop)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished:
        for o in engine.step():
            assert o.request_id == rid
            deltas.append(o.new_text)
            assert stop not in "".join(deltas)
            final = o
    assert final.finish_reason == "stop" and final.text == ref_text[:cut] and final.stop_reason == stop
    assert "".join(deltas) == final.text
    assert list(final.output_ids) == ref[: len(final.output_ids)]


def test_include_stop_str_in_output_keeps_the_stop_string(micro: Transformer) -> None:
    """vLLM's ``include_stop_str_in_output=True``: the text runs to the end of the stop string that ended it,
    and the stream (nothing held back: the stop string is kept) adds up to it."""
    tok = LetterTokenizer()
    engine = _engine(micro, tokenizer=tok)
    prompt = "helloworld"
    ref = _solo(micro, [tok.bos_token_id, *tok.encode(prompt)], SamplingParams(max_tokens=10))
    ref_text = tok.decode(ref)
    stop = ref_text[4:6]
    end = ref_text.find(stop) + len(stop)
    params = SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True, include_stop_str_in_output=True)
    rid = engine.add_request(prompt, params)
    deltas, final = [], None
    while engine.has_unfinished:
        for o in engine.step():
            assert o.request_id == rid
            deltas.append(o.new_text)
            final = o
    assert final.finish_reason == "stop" and final.text == ref_text[:end] and final.text.endswith(stop)
    assert "".join(deltas) == final.text and list(final.output_ids) == ref[:end]


def test_detokenize_false_gives_token_ids_and_no_text(micro: Transformer) -> None:
    """vLLM's ``detokenize=False``: the same tokens, EOS still stops, the text stays empty; stop strings with
    it are refused in vLLM's words."""
    tok = LetterTokenizer()
    p = _ids(12, seed=4)
    ref = _solo(micro, p, SamplingParams(max_tokens=6))
    engine = _engine(micro, tokenizer=tok)
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6, detokenize=False))
    assert list(out.output_ids) == ref and out.text == "" and out.finish_reason == "length"
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6))
    assert out.text == tok.decode(ref)  # detokenize=True (the default) as before
    tok.eos_token_id = ref[2]
    (out,) = _run(_engine(micro, tokenizer=tok), [p], SamplingParams(max_tokens=6, detokenize=False))
    assert list(out.output_ids) == ref[: ref.index(ref[2]) + 1] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop="ab", detokenize=False)
    for name in ("detokenize", "include_stop_str_in_output"):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            SamplingParams(**{name: 1})


def test_eos_stops_unless_ignored(micro: Transformer) -> None:
    tok = LetterTokenizer()
    p = _ids(12, seed=4)
    ref = _solo(micro, p, SamplingParams(max_tokens=6))
    tok.eos_token_id = ref[2]  # make the third output the EOS token
    engine = _engine(micro, tokenizer=tok)
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6))
    assert list(out.output_ids) == ref[: ref.index(ref[2]) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS is no stop reason (vLLM's), even when also a stop token id
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6, stop_token_ids=(ref[2],)))
    assert out.finish_reason == "stop" and out.stop_reason is None
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(ref[2],)))
    assert out.stop_reason == ref[2]  # EOS ignored: the stop token id is the reason
    (out,) = _run(engine, [p], SamplingParams(max_tokens=6, ignore_eos=True))
    assert list(out.output_ids) == ref and out.finish_reason == "length"


def test_b26_empty_prompt_is_rejected_before_any_state_changes(micro: Transformer) -> None:
    engine = _engine(micro, tokenizer=LetterTokenizer())
    free = engine.runner.pool.blocks.num_free
    for empty in ([], ""):
        with pytest.raises(ValueError, match="empty prompt"):
            engine.add_request(empty, SamplingParams(max_tokens=2))
    assert not engine.requests and engine.runner.pool.blocks.num_free == free
    assert engine.runner.stats.device.query_tokens == 0
    (out,) = _run(engine, [[5, 6, 7]], SamplingParams(max_tokens=3))
    assert list(out.output_ids) == _solo(micro, [5, 6, 7], SamplingParams(max_tokens=3))


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([3, 64], SamplingParams(), "token id 64 at index 1 is outside the vocabulary \\[0, 64\\)"),
        ([-1], SamplingParams(), "token id -1 at index 0 is outside the vocabulary \\[0, 64\\)"),
        ([2**31], SamplingParams(), "token id 2147483648 at index 0"),
        ([2**70], SamplingParams(), "token id 1180591620717411303424 at index 0"),
        (
            [3, 4],
            SamplingParams(stop_token_ids=(64,)),
            "stop token id 64 is outside the vocabulary \\[0, 64\\)",
        ),
        ([3, 4], SamplingParams(logit_bias={64: 1.0}), "logit_bias token id 64 is outside"),
        ([3, 4], SamplingParams(logit_bias={-1: 1.0}), "logit_bias token id -1 is outside"),
    ],
)
def test_b27_bad_token_ids_are_rejected_naming_the_id(micro, prompt, params, message) -> None:
    engine = _engine(micro)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.requests and not engine.has_unfinished
    (out,) = _run(engine, [[3, 4, 5]], SamplingParams(max_tokens=2))
    assert out.finish_reason == "length" and len(out.output_ids) == 2


def test_b28_prompt_at_the_context_limit(micro: Transformer) -> None:
    engine = _engine(micro, max_model_len=32)
    decoded: list[int] = []
    decode = engine.runner.decode
    engine.runner.decode = lambda sessions, tokens: (decoded.append(len(sessions)), decode(sessions, tokens))[
        1
    ]
    (out,) = _run(engine, [_ids(31, seed=1)], SamplingParams(max_tokens=1))
    assert len(out.output_ids) == 1 and out.finish_reason == "length"
    assert engine.runner.stats.computed_tokens == 31 and not decoded  # position 31 is never written
    with pytest.raises(
        ValueError, match=r"prompt \(32 tokens\) \+ max_tokens \(1\) = 33 tokens > max_model_len 32"
    ):
        engine.add_request(_ids(32, seed=2), SamplingParams(max_tokens=1))
    (score,) = _run(engine, [_ids(32, seed=2)], SamplingParams(max_tokens=0))  # scoring only: 32 <= 32
    assert score.output_ids == () and score.finish_reason == "length" and score.stop_reason is None
    with pytest.raises(ValueError, match=r"= 33 tokens > max_model_len 32"):
        engine.add_request(_ids(33, seed=3), SamplingParams(max_tokens=0))


def test_max_tokens_none_takes_the_context_left(micro: Transformer) -> None:
    """vLLM's max_tokens=None: generate until the context is full; the offline edge resolves it the same."""
    engine = _engine(micro, max_model_len=32)
    prepared = engine.prepare(_ids(20, seed=4), SamplingParams(max_tokens=None, ignore_eos=True))
    assert prepared.params.max_tokens == 12  # 32 - 20, an int below the edge
    (out,) = _run(engine, [_ids(20, seed=4)], SamplingParams(max_tokens=None))
    assert len(out.output_ids) == 12 and out.finish_reason == "length"
    assert out.output_ids == tuple(_solo(micro, _ids(20, seed=4), SamplingParams(max_tokens=12)))
    with pytest.raises(
        ValueError,
        match=r"prompt \(32 tokens\) \+ max_tokens \(1, None: the context left, at least 1\) = 33 tokens",
    ):
        engine.prepare(_ids(32, seed=2), SamplingParams(max_tokens=None))
    offline = check_request(micro, _ids(20, seed=4), SamplingParams(max_tokens=None), max_model_len=30)
    assert offline.params.max_tokens == 10


def test_max_model_len_tokens_fit_in_ceil_n_over_block_size_blocks(micro: Transformer) -> None:
    # vLLM's meaning: --max-model-len 64 with blocks of 4 tokens needs 16 blocks, not 17 (the last sampled
    # token is never fed back, so a request of 64 tokens holds the KV of 63; scoring 64 holds 64).
    with pytest.raises(ValueError, match=r"needs 16 blocks of 4 tokens, but the KV cache holds 15 blocks"):
        _engine(micro, blocks=15, max_model_len=64)
    engine = _engine(micro, blocks=16, max_num_seqs=2, budget=32, max_model_len=64)
    free = engine.runner.pool.blocks.num_free
    params = SamplingParams(max_tokens=40)
    prompts = [_ids(24, seed=5), _ids(24, seed=6)]  # 24 + 40 = exactly 64 each; together they preempt
    outs = _run(engine, prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.output_ids) == _solo(micro, p, params) and o.finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    engine.add_request(_ids(64, seed=7), SamplingParams(max_tokens=0))  # scoring: 64 KV entries, 16 blocks
    outs = [o for _ in range(4) for o in engine.step()]  # 2 chunks of 32; admitting it needs no 17th block
    assert [(o.output_ids, o.finish_reason) for o in outs] == [((), "length")]
    with pytest.raises(
        ValueError, match=r"prompt \(25 tokens\) \+ max_tokens \(40\) = 65 tokens > max_model_len 64"
    ):
        engine.add_request(_ids(25, seed=8), params)
    _assert_clean(engine, free)


def test_admission_reserves_a_decode_token_only_when_one_will_be_fed_back(micro: Transformer) -> None:
    # blocks of 4: a prompt of 8 fills 2 blocks; the decode slot of its next token would need a 3rd, which
    # only a request that feeds that token back (max_tokens >= 2) reserves; after a preemption the outputs
    # so far count as prompt (7 + 1 = 8 tokens) and the rule is the same
    engine = _engine(micro)
    oracle = engine.scheduler.cache
    for prompt, outputs, max_tokens, blocks in (
        (8, 0, 0, 2),
        (8, 0, 1, 2),
        (8, 0, 2, 3),
        (7, 1, 2, 2),
        (7, 1, 3, 3),
    ):
        engine.add_request(_ids(prompt, seed=prompt), SamplingParams(max_tokens=max_tokens))
        req = engine.scheduler.waiting[-1]
        req.output_ids += [5] * outputs
        assert oracle.admission_blocks(req) == blocks, (prompt, outputs, max_tokens)


def test_b29_fully_cached_prompt_beside_a_decoding_request(micro: Transformer) -> None:
    engine = _engine(micro, budget=16)
    a, b = _ids(20, seed=21), _ids(12, seed=22)
    params = SamplingParams(max_tokens=6)
    _run(engine, [b], params)  # B's whole prompt is now cached (its 2 usable blocks + a pool snapshot)
    steps = _record_steps(engine)
    ra = engine.add_request(a, params)
    for _ in range(3):  # A prefills and starts decoding
        engine.step()
    rb = engine.add_request(b, params)
    final: dict[str, RequestOutput] = {}
    engine.run_to_completion(lambda o: final.__setitem__(o.request_id, o) if o.finished else None)
    mixed = [plan for plan, _ in steps if plan.decodes and any(r.request_id == rb for r, _ in plan.prefills)]
    assert mixed and [r.request_id for r in mixed[0].decodes] == [ra]
    assert final[rb].provenance.hit_tokens == 8 and final[rb].provenance.computed_tokens == 4
    assert list(final[rb].output_ids) == _solo(micro, b, params)
    assert list(final[ra].output_ids) == _solo(micro, a, params)


def test_seeded_sampling_is_reproducible(micro: Transformer) -> None:
    engine = _engine(micro)
    p = _ids(10, seed=30)
    runs = [
        _run(engine, [p], SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=s))[0].output_ids
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_repeated_prompt_hits_the_device_pool_and_the_swa_pool(micro: Transformer) -> None:
    engine = _engine(micro)
    p = _ids(30, seed=40)
    first, second = (_run(engine, [p], SamplingParams(max_tokens=2))[0] for _ in range(2))
    assert first.provenance.hit_tokens == 0
    assert second.provenance.device_tokens == 28 and second.provenance.window_source == "swa-pool"
    assert second.cached_tokens == 28 and second.output_ids == first.output_ids


def test_settings_are_checked_at_construction(micro: Transformer) -> None:
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match=r"^max_model_len must be in"):
        _engine(micro, max_model_len=257)
    for bad in (8.5, "8", True):  # a whole number or nothing: not Python's '<=' TypeError
        with pytest.raises(ValueError, match=f"^max_model_len must be a whole number of tokens, got {bad!r}"):
            _engine(micro, max_model_len=bad)
    assert _engine(micro, max_model_len=np.int64(64)).max_model_len == 64  # numpy's ints are whole numbers
    with pytest.raises(ValueError, match=r"needs 16 blocks of 4 tokens, but the KV cache holds 10 blocks"):
        _engine(micro, blocks=10, max_model_len=64)
    engine = _engine(micro)
    engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="x")


def test_a_step_that_raises_leaves_nothing_held_after_abort(micro: Transformer) -> None:
    engine = _engine(micro, budget=16)
    free = engine.runner.pool.blocks.num_free
    b = engine.add_request(_ids(5, seed=50), SamplingParams(max_tokens=10))
    engine.step()  # b prefilled, first token sampled
    a = engine.add_request(_ids(5, seed=51), SamplingParams(max_tokens=1))

    def broken(sessions, tokens):
        raise RuntimeError("decode failed")

    engine.runner.decode = broken
    with pytest.raises(RuntimeError, match="decode failed"):
        engine.step()  # a's prefill finishes it, then b's decode raises before a is released
    assert engine.requests[a].finished and engine.requests[a].session is not None
    assert engine.abort_request(a) is None and engine.abort_request(b).finish_reason == "abort"
    _assert_clean(engine, free)


def test_window_state_kept_in_a_missing_persistent_tier_is_one_warning_naming_the_flag(
    micro: Transformer, tmp_path, caplog
) -> None:
    """A policy that keeps window state in the persistent tier (boundary-snapshot, checkpoint:K, full-store)
    with none and prefix caching on: one warning at engine construction, naming --persistent-dir and the
    tokens every hit recomputes (W + (L−1)(W−1) = 8 + 8·7 = 64 on micro). It tells the truth: a 41-token
    prompt run twice reuses nothing without the tier and 40 tokens with it. No warning otherwise."""
    prompt = _ids(41, seed=5)
    for policy, persistent, prefix, warns in (
        ("boundary-snapshot", None, True, True),
        ("checkpoint:8", None, True, True),
        ("full-store", None, True, True),
        ("boundary-snapshot", tmp_path / "kv", True, False),
        ("boundary-snapshot", None, False, False),
        ("bounded-replay", None, True, False),
        ("exact-recompute", None, True, False),
    ):
        opts = CacheOptions(
            kv_cache_memory=300 * micro.new_pool(1, block_size=BS).block_bytes,
            block_size=BS,
            policy=parse_policy(policy),
            persistent_dir=persistent,
            prefix_caching=prefix,
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvdiet.engine"):
            engine = LLMEngine(micro, ModelRunner(micro, opts).open(), max_model_len=128)
        messages = [r.getMessage() for r in caplog.records if r.name == "kvdiet.engine"]
        if warns:
            assert messages == [
                f"--swa-policy {policy} keeps window state in the persistent tier, but there is none "
                "(--persistent-dir none; CacheOptions(persistent_dir=None)): every prefix hit recomputes the 64 "
                "tokens below it, so no prefix of up to 64 tokens is reused and longer ones save only the "
                "tokens past that; give --persistent-dir DIR (CacheOptions(persistent_dir=DIR)) to reuse prefixes"
            ], messages
        else:
            assert messages == [], (policy, messages)
        if policy == "boundary-snapshot" and prefix:
            cached = []
            for _ in range(2):
                engine.add_request(prompt, SamplingParams(max_tokens=1))
                outs: list[RequestOutput] = []
                engine.run_to_completion(outs.append)
                cached.append(outs[-1].cached_tokens)
            assert cached == [0, 0 if warns else 40], (persistent, cached)
        engine.runner.close()


def test_the_offline_edge_keeps_max_position_embeddings_above_a_larger_max_model_len(
    micro: Transformer,
) -> None:
    """`check_request` with a ``max_model_len`` past the config's limit (256) still refuses a prompt past that
    limit at the edge, as the model's own check did there, rather than in the prefill after 256 tokens."""
    with pytest.raises(ContextLengthError, match=r"= 301 tokens > max_position_embeddings 256") as info:
        check_request(micro, _ids(300, seed=9), SamplingParams(max_tokens=1), max_model_len=1000)
    assert (info.value.limit, info.value.limit_name) == (256, "max_position_embeddings")
    ok = check_request(micro, _ids(250, seed=9), SamplingParams(max_tokens=None), max_model_len=1000)
    assert ok.params.max_tokens == 6  # the context left below 256
    at = check_request(micro, _ids(250, seed=9), SamplingParams(max_tokens=None), max_model_len=256)
    assert at.params.max_tokens == 6
