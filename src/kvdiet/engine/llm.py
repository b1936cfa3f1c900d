"""`LLM`: the offline Python API — a batch of prompts in, their completions out, through the engine.

    from kvdiet import LLM, SamplingParams
    with LLM(model="v4.1-mini") as llm:
        outs = llm.generate(["The KV cache", "Bounded replay"], SamplingParams(max_tokens=8))
        print(outs[0].text, outs[0].provenance)

All prompts go into one engine and run with continuous batching, exactly as in the server. `LLM.chat` takes
OpenAI-style conversations, checked and rendered as the server's ``/v1/chat/completions`` does.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from numbers import Integral
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvdiet.engine.args import EngineArgs
from kvdiet.engine.chat_messages import check_conversation
from kvdiet.engine.chat_template import chat_prompt_ids, chat_thinking
from kvdiet.engine.engine import LLMEngine
from kvdiet.engine.prepared import InvalidRequestError
from kvdiet.engine.request import RequestOutput
from kvdiet.engine.runner import CacheOptions
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import SchedulerConfig
from kvdiet.engine.vllm_args import check_vllm_only

__all__ = ["LLM"]

Prompt = str | Sequence[int]

_VLLM_ONLY = {  # vLLM's `LLM` arguments kvdiet does not implement → the values that change nothing
    "tensor_parallel_size": (1,),
    "pipeline_parallel_size": (1,),
    "trust_remote_code": (False, True),  # kvdiet runs no code from a checkpoint either way
    "enforce_eager": (False, True),  # no CUDA graphs yet: every step runs eagerly
    "dtype": ("auto", "float32"),  # activations are fp32 (weights keep their stored formats)
    "gpu_memory_utilization": (),  # the KV cache is sized in bytes: cache=CacheOptions(kv_cache_memory=...)
}

_VLLM_CHAT_ONLY = {  # vLLM's `LLM.chat` arguments kvdiet does not implement → the values that change nothing
    "lora_request": (None,),
    "chat_template": (None,),  # DeepSeek's template is built in (kvdiet.engine.chat_template)
    "chat_template_content_format": ("auto", "string", "openai"),  # text parts are joined either way
    "add_generation_prompt": (True,),  # the prompt always ends with the assistant's turn
    "continue_final_message": (False,),  # the last message must be the user's
    "tools": (None,),
    "mm_processor_kwargs": (None,),
}


def _model_and_weights(model: str | None, kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``LLM``'s ``model`` and ``weights`` as `EngineArgs` takes them: a checkpoint folder given as ``model`` (with
    no ``weights``) becomes the weights, its config read beside them; no model and no weights is v4.1-mini."""
    weights = kwargs.get("weights")
    if weights is None and model is not None and Path(model).is_dir():
        return None, {**kwargs, "weights": model}
    if model is None and weights is None:
        return "v4.1-mini", kwargs
    return model, kwargs


class LLM:
    """An engine for scripts. Loads the model and opens the cache system on construction; `close` (or a
    ``with`` block) closes the tiers.

    Args:
        model: preset, V4.1 / V4-Flash config path, or a checkpoint folder in the released format (as vLLM's
            ``LLM("/path/to/model")``: its weights, with the ``config.json`` beside them); None: the config beside
            ``weights`` when they are given, else ``v4.1-mini`` (the default).
        args: full `EngineArgs` (then the keywords below must be left out).
        seed, weights, kv_cache_dtype, max_model_len: see `EngineArgs`.
        cache: `CacheOptions` (device pool, persistent tier, SWA pool, policy); a block size or policy left
            unset is the model's default, as in ``kvdiet generate`` (`CacheOptions.for_model`: V4-Flash blocks of
            128 tokens and boundary-snapshot).
        max_num_seqs, max_num_batched_tokens: see `SchedulerConfig` (None: its defaults).
        tensor_parallel_size, pipeline_parallel_size, trust_remote_code, enforce_eager, dtype: vLLM's, taken at
            the values that change nothing here (1, 1, either bool, either bool, ``"auto"``/``"float32"``;
            `kvdiet.engine.vllm_args.check_vllm_only`); ``gpu_memory_utilization`` is refused: the KV cache is
            sized in bytes (``cache=CacheOptions(kv_cache_memory="8GB")``).
    Raises:
        ValueError, ConfigError: bad settings, refused before the model loads (`EngineArgs.create_engine`); a
            `kvdiet.setting_error.SettingError` names the setting by its keyword (``max_model_len``).
        TypeError: one of vLLM's arguments above at another value, named; an unknown keyword.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        args: EngineArgs | None = None,
        cache: CacheOptions | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        limits = {
            k: v
            for k, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens))
            if v is not None
        }
        vllm_only = {k: kwargs.pop(k) for k in list(kwargs) if k in _VLLM_ONLY}
        check_vllm_only("LLM", _VLLM_ONLY, vllm_only)
        if args is not None and (cache is not None or kwargs or limits):
            raise ValueError("give either args= or individual settings, not both")
        if args is None:
            model, kwargs = _model_and_weights(model, kwargs)
            args = EngineArgs(
                model=model, cache=cache or CacheOptions(), scheduler=SchedulerConfig(**limits), **kwargs
            )
        self.engine: LLMEngine = args.create_engine()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids) and return the final outputs in order.

        Args:
            prompts: one prompt or a list; a prompt is a text, token ids (a list of ints, or a 1-D numpy array
                or torch tensor: a 2-D one is a list of prompts) or a vLLM prompt dict (``{"prompt": text}``,
                ``{"prompt_token_ids": ids}``).
            sampling_params: one for all, or one per prompt (default `SamplingParams()`).
            progress: show a progress bar of finished requests.
            use_tqdm: vLLM's name for ``progress`` (a bool; None: ``progress`` decides).
        Raises:
            ValueError: an invalid prompt or parameters (checked for all prompts before any runs), or as many
                parameters as prompts were not given.
            TypeError: ``prompts`` neither a text, a prompt dict, nor a list or array (a bare int, bytes, a set),
                or ``sampling_params`` not `SamplingParams`.
        """
        if use_tqdm is not None:
            if not isinstance(use_tqdm, bool):
                raise TypeError(f"use_tqdm must be a bool or None, got {use_tqdm!r}")
            progress = use_tqdm
        batch = _as_batch(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        one = isinstance(params, SamplingParams) or not isinstance(params, Iterable)
        per = [params] * len(batch) if one else list(params)
        if any(not isinstance(p, SamplingParams) for p in per):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {params!r}")
        if len(per) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(per)} sampling parameters")
        prepared = [self.engine.prepare(p, sp) for p, sp in zip(batch, per, strict=True)]
        ids = [self.engine.add_prepared(r) for r in prepared]
        final: dict[str, RequestOutput] = {}
        bar = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
        )
        with bar:
            task = bar.add_task("requests", total=len(ids))
            try:
                while len(final) < len(ids):
                    for out in self.engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            bar.advance(task)
            except BaseException:
                for rid in ids:
                    self.engine.abort_request(rid)
                raise
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        use_tqdm: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **vllm_only: Any,
    ) -> list[RequestOutput]:
        """Reply to one conversation or to each of a list of them (vLLM's ``LLM.chat``), one output per
        conversation in order: each is checked as the server checks a ``/v1/chat/completions`` body's
        ``messages`` (`kvdiet.engine.chat_messages.check_conversation`), rendered with its chat template
        (`kvdiet.engine.chat_template.chat_prompt_ids`) and generated as `generate` does.

        Args:
            messages: one conversation, a list of OpenAI messages (``{"role": "user", "content": "hi"}``;
                content a string or a list of text parts; an object with ``model_dump()``, such as the OpenAI
                SDK's ``ChatCompletionMessage`` from a reply, is taken as its dump), or a list of such lists.
            sampling_params, progress, use_tqdm: as `generate` (one per conversation, or one for all).
            chat_template_kwargs: ``{"thinking": True}`` opens the reply with ``<think>`` (the server's).
            vllm_only: vLLM's ``lora_request``, ``chat_template``, ``chat_template_content_format``,
                ``add_generation_prompt``, ``continue_final_message``, ``tools``, ``mm_processor_kwargs``, taken
                at the values that change nothing (None, None, any of its three, True, False, None, None).
        Raises:
            InvalidRequestError (a ValueError): a message the server would refuse, named by its path and index
                (``messages.0.content: must not be an empty array ...``; ``conversation 1: `` before it for a
                list of conversations), a bad ``chat_template_kwargs``, or a model without a tokenizer; any
                prompt `generate` refuses (checked for every conversation before any runs).
            TypeError: ``messages`` not a list; one of vLLM's arguments above at another value, or an unknown
                keyword.
        """
        unknown = sorted(set(vllm_only) - set(_VLLM_CHAT_ONLY))
        if unknown:
            raise TypeError(f"LLM.chat() got an unexpected keyword argument {unknown[0]!r}")
        check_vllm_only("LLM.chat", _VLLM_CHAT_ONLY, vllm_only)
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise TypeError(
                f"messages must be a list of messages (dicts) or a list of such lists, got {messages!r}"
            )
        many = bool(messages) and all(isinstance(c, Sequence) and not isinstance(c, str) for c in messages)
        conversations = list(messages) if many else [messages]
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer, so no chat template: give token ids to generate",
                param="messages",
            )
        thinking = chat_thinking(chat_template_kwargs)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                checked = check_conversation(conversation)
                prompts.append(chat_prompt_ids(tokenizer, checked, thinking=thinking))
            except InvalidRequestError as exc:
                said = f"conversation {i}: {exc}" if many else str(exc)
                raise InvalidRequestError(said, param=exc.param) from None
        return self.generate(prompts, sampling_params, progress=progress, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Abort what is left and close the cache tiers."""
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """``prompts`` as a list of prompts: a text, a list of token ids (ints, numpy's too; not bools) or a vLLM
    prompt dict (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``) is one. A 1-D numpy array or torch
    tensor is a list of token ids, a 2-D one a list of such prompts. Token ids come back as Python ints.

    Raises:
        ValueError: an empty list (no prompt; an empty token-id prompt is refused too, case B26), or a token-id
            list (the prompt, or one of a list of prompts) with an item that is not an integer (named with its
            index; the engine's and the server's words).
        TypeError: a bare int, bytes, a set (no order), or a prompt dict with other keys; named.
    """
    if isinstance(prompts, str | Mapping):
        return [_one_prompt(prompts, "")]
    items = _listed(prompts)
    if not items:
        raise ValueError(
            "no prompt: give a text, a list of token ids, or a list of prompts (not an empty list)"
        )
    if any(not _is_prompt(t) for t in items):  # token ids: scalars (bools refused as ids)
        return [_check_ints(items, "")]
    # a list of prompts: each by the same rules
    return [_one_prompt(item, f" of prompt {p}") for p, item in enumerate(items)]


def _one_prompt(item: object, where: str) -> Prompt:
    """One prompt: a text, a vLLM prompt dict (``TextPrompt`` / ``TokensPrompt`` with that one key), or token
    ids (``where``: its place in a list, for the messages)."""
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        if set(item) == {"prompt"} and isinstance(item["prompt"], str):
            return item["prompt"]
        if set(item) == {"prompt_token_ids"}:
            return _check_ints(_listed(item["prompt_token_ids"]), where)
        raise TypeError(
            "a prompt dict takes one key, 'prompt' (a text) or 'prompt_token_ids' (token ids), "
            f"got {dict(item)!r}{where}"
        )
    return _check_ints(_listed(item), where)


def _is_prompt(item: object) -> bool:
    """Whether a list item is a prompt (a text, a sequence, a prompt dict, or an array of at least one
    dimension) rather than a token id."""
    return isinstance(item, str | Sequence | Mapping) or getattr(item, "ndim", 0) >= 1


def _listed(items: object) -> list:
    """``items`` as a list: an array (numpy or torch) by its ``tolist`` (Python scalars, nested by dimension).

    Raises:
        TypeError: ``items`` is neither an array of at least one dimension nor an ordered iterable (a bare int,
            a 0-d array, bytes, a set), named.
    """
    if getattr(items, "ndim", 1) >= 1 and hasattr(items, "tolist"):
        return items.tolist()
    if (
        getattr(items, "ndim", 1) == 0
        or not isinstance(items, Iterable)
        or isinstance(items, bytes | bytearray | AbstractSet)
    ):
        raise TypeError(f"prompts must be a text, a list of token ids or a list of prompts, got {items!r}")
    return list(items)


def _check_ints(ids: list, where: str) -> list[int]:
    """``ids`` as Python ints; refuse an item that is not an int (`numbers.Integral`: numpy's too; bools and
    floats refused), named by its index in the words of `kvdiet.model.token_ids.check_token_ids` and of the
    server (``... is not an integer``)."""
    for i, t in enumerate(ids):
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise ValueError(f"token id {t!r} at index {i}{where} is not an integer")
    return [operator.index(t) for t in ids]
