"""The offline `LLM` API: batches in input order, per-prompt parameters, validation before anything runs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvdiet import LLM, SamplingParams
from kvdiet.engine.args import EngineArgs
from kvdiet.engine.generate import generate
from kvdiet.engine.prepared import ContextLengthError
from kvdiet.engine.runner import CacheOptions


@pytest.fixture(scope="module")
def llm():
    with LLM("v4.1-micro", cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20), max_num_seqs=2) as llm:
        yield llm


def test_outputs_come_back_in_prompt_order_and_equal_solo_runs(llm) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(1, 30)), [3]]
    params = [SamplingParams(max_tokens=n) for n in (3, 5, 2)]
    outs = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs, strict=True):
        assert list(o.output_ids) == generate(llm.engine.model, p, sp).output_ids
        assert o.prompt_tokens == len(p) and len(o.output_ids) == sp.max_tokens
    (single,) = llm.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=3))  # a list of ints is one prompt
    assert single.output_ids == outs[0].output_ids
    assert single.cached_tokens == 4  # the first block, from the device pool


def test_numpy_token_ids_are_ints(llm) -> None:
    """numpy's integers and int arrays (numpy or torch) are token ids (as in `SamplingParams`), in one prompt or
    a list of prompts, with the outputs of the same Python ints; numpy's bools and floats are not."""
    params = SamplingParams(max_tokens=2)
    (plain,) = llm.generate([5, 6, 7], params)
    (arr,) = llm.generate(list(np.array([5, 6, 7], dtype=np.int64)), params)
    (_, listed) = llm.generate([[4], [np.int32(5), np.uint8(6), 7]], [params, params])
    assert arr.output_ids == plain.output_ids == listed.output_ids
    for bad in ([np.True_, 5], [np.float32(5.0), 6]):
        with pytest.raises(ValueError, match=re.escape(f"token id {bad[0]!r} at index 0 is not an integer")):
            llm.generate(bad, params)
    # arrays: a 1-D numpy array or torch tensor is one prompt, a list of them or a 2-D one a list of prompts
    (one,) = llm.generate(np.array([5, 6, 7], dtype=np.int32), params)
    (_, two) = llm.generate([np.array([4]), torch.tensor([5, 6, 7])], [params, params])
    (_, rows) = llm.generate(torch.tensor([[4, 4, 4], [5, 6, 7]]), [params, params])
    assert one.output_ids == two.output_ids == rows.output_ids == plain.output_ids
    with pytest.raises(ValueError, match=re.escape("token id 5.0 at index 0 of prompt 1 is not an integer")):
        llm.generate([np.array([4]), np.array([5.0, 6.0])], params)
    for bare in (5, np.array(5)):
        with pytest.raises(
            TypeError, match="prompts must be a text, a list of token ids or a list of prompts"
        ):
            llm.generate(bare, params)


def test_bad_batches_are_rejected_before_any_request_runs(llm) -> None:
    free = llm.engine.runner.pool.blocks.num_free
    with pytest.raises(ValueError, match="2 prompts but 1 sampling parameters"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams()])
    with pytest.raises(ValueError, match="no prompt"):
        llm.generate([])  # not zero prompts: an empty token-id prompt too (B26)
    for bad, at in (([3.0, 4], 0), ([2, True], 1), ([2, "x"], 1), ([1.5, 2], 0)):
        with pytest.raises(ValueError) as exc:  # the server's words for the same fault (test_server_app)
            llm.generate(bad)
        assert str(exc.value) == f"token id {bad[at]!r} at index {at} is not an integer"
    with pytest.raises(ValueError, match="token id True at index 0 of prompt 1 is not an integer"):
        llm.generate([[1, 2], [True, 2]])  # each prompt of a list by the same rule
    with pytest.raises(ValueError) as exc:
        llm.generate([[1, 2], [3, 99]], SamplingParams(max_tokens=1))
    assert str(exc.value) == "token id 99 at index 1 is outside the vocabulary [0, 64)"
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    assert not llm.engine.requests and llm.engine.runner.pool.blocks.num_free == free


def test_vllm_prompt_dicts_and_what_is_no_prompt(llm) -> None:
    """vLLM's ``{"prompt_token_ids": ids}`` is those ids (``{"prompt": text}`` that text); bytes, a set (no
    order), a dict with other keys, and parameters that are not `SamplingParams` are TypeErrors, before any
    request runs."""
    free = llm.engine.runner.pool.blocks.num_free
    params = SamplingParams(max_tokens=2)
    (plain,) = llm.generate([5, 6, 7], params)
    (one,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    (_, listed) = llm.generate([{"prompt_token_ids": np.array([4])}, {"prompt_token_ids": (5, 6, 7)}], params)
    assert one.output_ids == listed.output_ids == plain.output_ids
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate({"prompt": "a text prompt"})  # a text, as vLLM reads it: this model has no tokenizer
    with pytest.raises(ValueError, match=re.escape("token id 2.5 at index 1 of prompt 0 is not an integer")):
        llm.generate([{"prompt_token_ids": [1, 2.5]}])
    with pytest.raises(TypeError, match="a prompt dict takes one key"):
        llm.generate({"prompt": "x", "multi_modal_data": {}})
    for bad in (b"\x05\x06", {5, 6, 7}):
        with pytest.raises(
            TypeError, match="prompts must be a text, a list of token ids or a list of prompts"
        ):
            llm.generate(bad, params)
    for bad_params in ({"max_tokens": 2}, 3, [params, "greedy"]):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
            llm.generate([[5], [6]], bad_params)
    assert not llm.engine.requests and llm.engine.runner.pool.blocks.num_free == free


def test_the_weights_seed_is_an_int_or_none() -> None:
    """`EngineArgs.seed` (``LLM(seed=...)``, ``--seed``): an int in [-2**63, 2**64) (torch's range), numpy's
    too, or None for 0."""
    assert EngineArgs(seed=None).seed == 0 and EngineArgs(seed=np.uint64(2**64 - 1)).seed == 2**64 - 1
    assert EngineArgs(seed=-(2**63)).seed == -(2**63)
    for bad in ("1", 1.5, True):
        with pytest.raises(TypeError, match=re.escape(f"seed must be an int or None, got {bad!r}")):
            EngineArgs(seed=bad)
    for bad in (-(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match=re.escape(f"seed must be in [-2**63, 2**64), got {bad}")):
            EngineArgs(seed=bad)


@pytest.mark.parametrize("n", [256, 257, 400])
def test_every_prompt_that_does_not_fit_gets_the_context_length_error(llm, n) -> None:
    """A prompt past ``max_position_embeddings`` too (257 ids on v4.1-micro, limit 256) gets the documented
    `ContextLengthError`, not the model's position check, and before any state changes."""
    free = llm.engine.runner.pool.blocks.num_free
    with pytest.raises(ContextLengthError) as info:
        llm.generate([[5] * n, [6, 7]], SamplingParams(max_tokens=1))
    assert str(info.value) == (
        f"prompt ({n} tokens) + max_tokens (1) = {n + 1} tokens > max_model_len 256; shorten the prompt or lower "
        "max_tokens"
    )
    assert (info.value.prompt_tokens, info.value.limit, info.value.param) == (n, 256, "prompt")
    assert not llm.engine.requests and llm.engine.runner.pool.blocks.num_free == free
    with pytest.raises(
        ContextLengthError, match=rf"^prompt \({n} tokens\) \+ max_tokens \(1, None: the context"
    ):
        llm.generate([5] * n, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match=rf"token id 64 at index {n} is outside the vocabulary \[0, 64\)"):
        llm.generate([5] * n + [64])  # a bad id is still named first, as vLLM does


def test_the_length_refusal_writes_every_count_in_one_format() -> None:
    """Each count with thousands separators: the prompt's was ``1,024`` beside ``1025`` and ``1024``."""
    said = str(ContextLengthError(1024, 4096, 1024, "max_model_len", max_tokens_origin="sent as max_tokens"))
    assert said == (
        "prompt (1,024 tokens) + max_tokens (4,096, sent as max_tokens) = 5,120 tokens > max_model_len 1,024; "
        "shorten the prompt or lower max_tokens"
    )
    said = str(ContextLengthError(1, 1, 1, "max_position_embeddings"))
    assert said.startswith("prompt (1 token) + max_tokens (1) = 2 tokens > max_position_embeddings 1;")


@pytest.fixture(scope="module")
def chat_llm():
    """v4.1-mini: the DeepSeek tokenizer, so chat runs through the real template."""
    with LLM("v4.1-mini", max_model_len=512, cache=CacheOptions(kv_cache_memory=16 << 20)) as llm:
        yield llm


def test_chat_renders_the_servers_template_and_generates(chat_llm) -> None:
    """``LLM.chat`` (vLLM's): one conversation or a list of them, each rendered with the chat template the
    server's ``/v1/chat/completions`` uses and generated as its token ids are by ``generate``, in order."""
    from kvdiet.engine.chat_template import render_chat

    tok = chat_llm.engine.tokenizer
    params = SamplingParams(max_tokens=3)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    second = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Bounded "}, {"type": "text", "text": "replay"}],
        }
    ]
    want = [chat_llm.generate([tok.encode(render_chat(c))], params)[0] for c in (first, second)]
    assert want[0].prompt_tokens == len(
        tok.encode("<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is a KV cache?<｜Assistant｜></think>")
    )
    (one,) = chat_llm.chat(first, params, use_tqdm=False)
    both = chat_llm.chat([first, second], [params, params])
    for got, expected in zip([one, *both], [want[0], *want], strict=True):
        assert (got.prompt_tokens, got.output_ids) == (expected.prompt_tokens, expected.output_ids)
    (thinking,) = chat_llm.chat(second, params, chat_template_kwargs={"thinking": True})
    (think_ref,) = chat_llm.generate([tok.encode(render_chat(second, thinking=True))], params)
    assert thinking.output_ids == think_ref.output_ids and thinking.prompt_tokens == want[1].prompt_tokens
    (vllm,) = chat_llm.chat(first, params, add_generation_prompt=True, chat_template=None, tools=None)
    assert vllm.output_ids == one.output_ids


def test_chat_refuses_what_the_server_refuses_naming_the_message(chat_llm, llm) -> None:
    """The server's message checks, in its words, with the message's index (and the conversation's, for a
    list of them); nothing runs before every conversation is checked."""
    from kvdiet.engine.prepared import InvalidRequestError

    user = {"role": "user", "content": "hi"}
    for messages, said in (
        ([user, {"role": "user", "content": []}], "messages.1.content: must not be an empty array"),
        ([{"role": "tool", "content": "x"}], "messages.0.role: role 'tool' is not supported"),
        ([{"role": "user", "content": "x", "foo": 1}], "messages.0.foo: Extra inputs are not permitted"),
        ([user, {"role": "assistant", "content": "x"}], "the last message must be a user message"),
        ([], "messages must contain at least one message"),
        (
            [[user], [{"role": "user", "content": None}]],
            "conversation 1: messages.0.content: must be a string",
        ),
        ([[user], [user, {"role": "assistant", "content": "a"}]], "conversation 1: the last message must be"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            chat_llm.chat(messages, SamplingParams(max_tokens=1))
        assert str(info.value).startswith(said) and info.value.param == "messages", info.value
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs takes only 'thinking'"):
        chat_llm.chat([user], chat_template_kwargs={"thinking": "yes"})
    with pytest.raises(TypeError, match="add_generation_prompt=False is not supported by kvdiet"):
        chat_llm.chat([user], add_generation_prompt=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        chat_llm.chat([user], temperature=0)
    with pytest.raises(TypeError, match="messages must be a list of messages"):
        chat_llm.chat("hi")
    with pytest.raises(InvalidRequestError, match="no tokenizer, so no chat template"):
        llm.chat([user])
    assert not chat_llm.engine.requests and not chat_llm.engine.has_unfinished
