"""Sampling parameters are validated before anything runs; greedy and filtered sampling pick what they should."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdiet.engine.sampling import SamplingParams, sample, sampling_generator


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"max_tokens": -1}, "max_tokens must be >= 0"),
     ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
     ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
     ({"temperature": 10**400}, "temperature must be a finite number >= 0, got 1000"),  # the sampler's / raised
     ({"stop": ["ok", "a\ud800"]}, "stop string 1: the text is not valid Unicode: unpaired surrogate U.D800"),
     ({"top_k": -2}, "top_k must be >= 1, or 0 or -1 for all tokens"),
     ({"top_p": 0.0}, "top_p must be in (0, 1]"), ({"top_p": 1.5}, "top_p must be in (0, 1]")],
)  # fmt: skip
def test_invalid(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"max_tokens": "2"}, "max_tokens must be an int or None, got '2'"),
     ({"max_tokens": 2.0}, "max_tokens must be an int or None, got 2.0"),
     ({"top_k": True}, "top_k must be an int, got True"), ({"temperature": "1"}, "temperature must be a number"),
     ({"top_p": None}, "top_p must be a number"), ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
     ({"stop": ["a", 5]}, "stop must be a string or a sequence of strings, got an item 5"),
     ({"stop_token_ids": (1, True)}, "stop_token_ids must be ints, got True"),
     ({"logit_bias": {63.0: 100}}, r"logit_bias keys must be token ids \(ints\), got 63\.0"),
     ({"logit_bias": {True: 100}}, r"logit_bias keys must be token ids \(ints\), got True"),
     ({"logit_bias": {"5": 1}}, r"logit_bias keys must be token ids \(ints\), got '5'"),
     ({"logit_bias": {5: "1"}}, "logit_bias of token 5 must be a number, got '1'"),
     ({"logit_bias": [(5, 1)]}, "logit_bias must be a mapping of token id to bias"),
     ({"stop": 5}, "stop must be a string or a sequence of strings, got 5"),
     ({"stop": b"ab"}, "stop must be a string or a sequence of strings, got b'ab'"),
     ({"stop_token_ids": 7}, "stop_token_ids must be a sequence of ints, got 7"),
     ({"ignore_eos": "no"}, "ignore_eos must be a bool, got 'no'"), ({"ignore_eos": 1}, "ignore_eos must be a bool"),
     ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None")],
)  # fmt: skip
def test_wrong_types_are_named(kwargs: dict, needle: str) -> None:
    """A value of the wrong type is named (not Python's '<' TypeError from the range checks)."""
    with pytest.raises(TypeError, match=needle):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_numbers() -> None:
    """numpy's integers and floats are ints and numbers (``operator.index``, ``numbers.Real``), as they were
    before the type checks; they are kept as Python's int and float, the same values."""
    params = SamplingParams(
        max_tokens=np.int64(3), top_k=np.int32(5), temperature=np.float32(0.5), top_p=np.float64(0.25),
        seed=np.uint64(2**64 - 1),
    )  # fmt: skip
    assert (params.max_tokens, params.top_k, params.temperature, params.top_p) == (3, 5, 0.5, 0.25)
    assert params.seed == 2**64 - 1 and type(params.seed) is int and type(params.max_tokens) is int
    assert type(params.top_k) is int and type(params.temperature) is float
    with pytest.raises(TypeError, match=r"max_tokens must be an int or None, got np\.True_"):
        SamplingParams(max_tokens=np.bool_(True))
    ids = SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids  # no array truth test
    assert ids == (3, 4) and all(type(t) is int for t in ids)
    assert SamplingParams(stop_token_ids=torch.tensor([5, 6])).stop_token_ids == (5, 6)


def test_collections_are_normalised_as_vllm_reads_them() -> None:
    """One stop string is one stop (not its characters); ``logit_bias=None`` is no bias; numpy ids and biases
    are kept as Python's int and float; a list of stop ids becomes a tuple; ``stop=None`` and
    ``stop_token_ids=None`` are none (vLLM's defaults)."""
    params = SamplingParams(
        stop=".\x01", stop_token_ids=[np.int64(7)], logit_bias={np.int32(5): np.float32(2)}
    )
    assert (
        params.stop == (".\x01",) and params.stop_token_ids == (7,) and type(params.stop_token_ids[0]) is int
    )
    assert params.logit_bias == {5: 2.0} and [type(k) for k in params.logit_bias] == [int]
    assert type(params.logit_bias[5]) is float
    assert SamplingParams(logit_bias=None).logit_bias == {} and SamplingParams(stop=["a", "b"]).stop == (
        "a",
        "b",
    )
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams(stop=(), stop_token_ids=())
    logits = torch.zeros(8)
    assert sample(logits, SamplingParams(logit_bias={np.int64(3): 50.0})) == 3


def test_a_bias_past_floats_range_is_out_of_range() -> None:
    """An int bias too large for a float is a bias outside [-100, 100] (a ValueError, not an OverflowError)."""
    with pytest.raises(ValueError, match=r"logit_bias of token 1 must be in \[-100, 100\], got -1000"):
        SamplingParams(logit_bias={1: -(10**400)})


def test_stop_token_outside_vocab() -> None:
    with pytest.raises(ValueError, match=r"stop token id 64 is outside the vocabulary \[0, 64\)"):
        SamplingParams(stop_token_ids=(1, 64)).check_vocab(64)


def test_greedy_and_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert sample(logits, SamplingParams()) == 1  # argmax, lowest id on ties
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(50)}
    assert picks == {1, 2}
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert {sample(peaked, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(20)} == {0}


def test_logit_bias_shifts_the_choice_and_is_range_checked() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5])
    assert sample(logits, SamplingParams()) == 1
    assert sample(logits, SamplingParams(logit_bias={2: 0.6})) == 2
    assert logits.tolist() == [0.0, 1.0, 0.5]  # the caller's logits are not changed
    with pytest.raises(ValueError, match="logit_bias of token 2 must be in"):
        SamplingParams(logit_bias={2: 101.0})
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=("",))


def test_tiny_temperatures_are_greedy_and_infinite_ones_rejected() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=t), gen) for t in (1e-40, 1e-300, 5e-6)} == {1}
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("inf"))


def test_a_top_p_below_fp32_range_keeps_the_most_likely_token() -> None:
    """Found by schemathesis (issue 18): ``top_p`` 5e-324 is 0 once compared in fp32, which cut every token
    and crashed the engine (``invalid multinomial distribution``)."""
    logits = torch.tensor([0.1, 2.0, -1.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=5e-324), gen) for _ in range(10)} == {1}


def test_top_k_minus_one_means_all_tokens_as_over_http() -> None:
    """vLLM's "disabled" top_k, -1, is 0 (all tokens) in the Python API as in a request body (issue ux41.1)."""
    from kvdiet.server.protocol import CompletionRequest

    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert CompletionRequest(prompt="x", top_k=-1).sampling_params(4).top_k == 0
    logits = torch.tensor([0.0, 3.0, 3.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=-1), gen) for _ in range(200)}
    assert picks == {0, 1, 2, 3}


def test_vllm_only_arguments_are_taken_at_their_defaults_and_named_otherwise() -> None:
    """vLLM's arguments kvdiet does not implement: spelled out at the value that changes nothing they are
    no-ops (the same parameters as without them); at any other value a TypeError (what an unknown keyword
    was) names the argument and says kvdiet does not support it; other unknown keywords stay Python's."""
    plain = SamplingParams(max_tokens=3, temperature=0.5)
    spelled = SamplingParams(
        max_tokens=3, temperature=0.5, n=1, best_of=None, presence_penalty=0.0, frequency_penalty=0.0,
        repetition_penalty=1.0, min_p=0.0, min_tokens=0, logprobs=None, prompt_logprobs=None,
    )  # fmt: skip
    assert spelled == plain and repr(spelled) == repr(plain)
    assert SamplingParams(best_of=1, presence_penalty=0, repetition_penalty=1) == SamplingParams()
    for name, value in (
        ("n", 2), ("best_of", 2), ("presence_penalty", 0.5), ("frequency_penalty", -0.1),
        ("repetition_penalty", 1.2), ("min_p", 0.05), ("min_tokens", 4), ("logprobs", 0), ("logprobs", 5),
        ("prompt_logprobs", 1), ("n", True), ("min_tokens", False), ("repetition_penalty", float("nan")),
    ):  # fmt: skip
        with pytest.raises(TypeError, match=rf"^{name}={value!r} is not supported by kvdiet: SamplingParams "
                           rf"accepts vLLM's {name} only as {name}="):  # fmt: skip
            SamplingParams(**{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_beam_search'"):
        SamplingParams(use_beam_search=False)


def test_every_bit_of_a_seed_changes_the_draws() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: seeds 1 and 2**32 + 1, -1 and 2**32 - 1, 0 and 2**63
    drew the same tokens. `sampling_generator` draws as torch does for seeds in [0, 2**32) and differently for
    seeds that differ only in their high bits (or in sign); the range is checked."""

    def draws(seed: int) -> torch.Tensor:
        return torch.rand(8, generator=sampling_generator(seed))

    for seed in (0, 1, 7, 2**31, 2**32 - 1):
        assert torch.equal(draws(seed), torch.rand(8, generator=torch.Generator().manual_seed(seed)))
    seeds = [0, 1, -1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 7, 7, 2**40 + 1, 2**63, 2**63 - 1, -(2**62)]
    assert len({tuple(draws(s).tolist()) for s in seeds}) == len(seeds)
    assert torch.equal(draws(-1), draws(2**64 - 1)) and torch.equal(
        draws(-(2**63)), draws(2**63)
    )  # mod 2**64
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must be in"):
            sampling_generator(bad)
