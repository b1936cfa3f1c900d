"""Single-request generation through the cache system: load a model, look the prompt up, prefill, decode.

The offline path behind ``kvdiet generate``: one request at a time through a `KVCache` (device pool, prefix
cache, persistent tier, SWA pool, replay). Batching, scheduling and the server come from the engine proper.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdiet.config import ConfigError, ModelConfig, load_config, model_config_path
from kvdiet.engine.kv_cache import CacheOptions, KVCache, Provenance
from kvdiet.engine.progress import DEFAULT_INTERVAL_S, PrefillProgress
from kvdiet.engine.sampling import SamplingParams, sample
from kvdiet.model.engram_hash import compressed_token_map
from kvdiet.model.loader import load_checkpoint
from kvdiet.model.state import CacheBytes
from kvdiet.model.transformer import Transformer
from kvdiet.tokenizer import Tokenizer

__all__ = ["GenerateResult", "check_request", "generate", "load_model", "private_cache"]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What one generation did.

    Attributes:
        prompt_tokens: prompt length in tokens.
        output_ids: generated token ids.
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (max_tokens reached).
        prefill_seconds / decode_seconds: wall time of each phase (prefill includes the prefix lookup,
            loads from the persistent tier, restore or replay).
        cache: measured cache bytes at the end.
        provenance: where the prompt's tokens came from (device, persistent, SWA pool, replayed, computed).
    """

    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float
    cache: CacheBytes
    provenance: Provenance

    @property
    def prefill_computed_tokens_per_second(self) -> float:
        """Tokens the prefill ran through the model (computed past the hit, plus any replayed below it) per
        second of prefill; a cache hit's tokens are not in it (they were loaded, not computed)."""
        p = self.provenance
        tokens = p.computed_tokens + p.replayed_tokens
        return tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.output_ids) / self.decode_seconds if self.decode_seconds else 0.0


def load_model(
    name_or_path: str | None,
    *,
    seed: int = 0,
    weights: str | Path | None = None,
    exact: bool = False,
    numerics: str = "auto",
    expert_cache_bytes: int | None = None,
) -> tuple[Transformer, Tokenizer | None]:
    """A V4.1 model (seeded random weights, or a checkpoint) and its tokenizer.

    With ``weights`` the model is built from the checkpoint (`kvdiet.model.loader.load_checkpoint`: routed
    experts read on first use, resident memory far below the checkpoint's size); its config is
    ``name_or_path`` or, when that is None, the ``config.json`` beside the weights. The load report is kept
    as ``model.load_report``. The tokenizer is the checkpoint's ``tokenizer.json`` when it has one, else the
    real DeepSeek tokenizer for configs of its vocabulary size (129,280); smaller test configs get none
    (prompts are then token ids).

    Raises:
        ConfigError: not a V4.1 config, or no config at all.
        kvdiet.model.loader.WeightsError: the weights do not fit the config.
        kvdiet.model.memory.InsufficientMemoryError: the model cannot fit in memory (before any allocation).
    """
    if name_or_path is None:
        found = model_config_path(weights)
        if found is None:
            raise ConfigError(f"no config.json beside the weights {weights}; give --model")
        name_or_path = str(found)
    cfg = load_config(name_or_path)
    if not isinstance(cfg, ModelConfig) or not cfg.is_v41:
        raise ConfigError(f"{name_or_path!r} is not a DeepSeek-V4.1 config; generate runs V4.1 models only")
    tokenizer = _tokenizer_for(cfg, weights)
    token_map = None
    if tokenizer is not None and cfg.engram_layer_ids:
        token_map, _ = compressed_token_map(tokenizer)
    elif weights is not None and cfg.engram_layer_ids and cfg.engram_compressed_vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"{weights}: Engram needs the compressed-token map of the tokenizer, and no tokenizer.json is "
            f"beside the weights (vocabulary {cfg.vocab_size:,}, not DeepSeek's)"
        )
    if weights is None:
        model = Transformer.from_config(cfg, seed=seed, exact=exact, token_map=token_map)
        model.load_report = None
    else:
        model, report = load_checkpoint(
            weights,
            config=cfg,
            token_map=token_map,
            numerics=numerics,
            exact=exact,
            expert_cache_bytes=expert_cache_bytes,
        )
        model.load_report = report
    return model, tokenizer


def _tokenizer_for(cfg: ModelConfig, weights: str | Path | None) -> Tokenizer | None:
    """The checkpoint's own ``tokenizer.json`` when it has one, else DeepSeek's for its vocabulary size."""
    folder = None if weights is None else (Path(weights) if Path(weights).is_dir() else Path(weights).parent)
    if folder is not None and (folder / "tokenizer.json").is_file():
        return Tokenizer(folder / "tokenizer.json")
    return Tokenizer.deepseek() if cfg.vocab_size == 129_280 else None


def check_request(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """Validate a prompt and its sampling parameters for ``model``; returns the ids as int64 [N].

    Raises:
        ValueError: bad token ids (see `Transformer.check_tokens`), stop ids outside the vocabulary, or a
            prompt plus ``max_tokens`` beyond ``max_position_embeddings`` (the real numbers in the message).
    """
    params.check_vocab(model.cfg.vocab_size)
    ids = model.check_tokens(prompt_ids)
    limit = model.cfg.max_position_embeddings
    if ids.numel() + params.max_tokens > limit:
        raise ValueError(
            f"prompt {ids.numel()} + max_tokens {params.max_tokens} = "
            f"{ids.numel() + params.max_tokens} > max_position_embeddings {limit}"
        )
    return ids


def private_cache(model: Transformer, num_tokens: int, options: CacheOptions | None = None) -> KVCache:
    """A `KVCache` with a device pool just large enough for one request of ``num_tokens`` tokens."""
    opts = options or CacheOptions()
    probe = model.new_pool(1, block_size=opts.block_size)
    blocks = -(-num_tokens // opts.block_size) + 1
    return KVCache(model, dataclasses.replace(opts, kv_cache_memory=blocks * probe.block_bytes))


def generate(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    cache: KVCache | None = None,
    chunk_size: int = 512,
    progress: bool = False,
    progress_interval_s: float = DEFAULT_INTERVAL_S,
) -> GenerateResult:
    """Look ``prompt_ids`` up in ``cache``, prefill the rest in chunks of ``chunk_size`` tokens, then decode up
    to ``params.max_tokens``; the blocks go back to the pool (and window state to its tier) at the end.

    Args:
        cache: the cache system (an open `KVCache`); None → a private one without tiers, sized for this
            request.
        progress: report the prefill on stderr (`PrefillProgress`: a bar on a terminal, else a line every
            ``progress_interval_s`` seconds).
    Raises:
        ValueError: empty or invalid prompt, a prompt plus ``max_tokens`` beyond the context, bad
            ``chunk_size`` — all before any state or tier changes.
        NoFreeBlocksError: the device pool cannot hold the request.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids = check_request(model, prompt_ids, params)
    if cache is None:
        cache = private_cache(model, ids.numel() + params.max_tokens)
    start = time.perf_counter()
    session = cache.start(ids.tolist())
    try:
        done = session.state.num_tokens
        with PrefillProgress(ids.numel(), done=done, enabled=progress, interval_s=progress_interval_s) as bar:
            logits = cache.prefill(session, chunk_size=chunk_size, progress=bar)
        prefill_s = time.perf_counter() - start
        generator = torch.Generator().manual_seed(params.seed or 0)
        out: list[int] = []
        finish = "length"
        start = time.perf_counter()
        while len(out) < params.max_tokens:
            token = sample(logits, params, generator)
            out.append(token)
            if token in params.stop_token_ids:
                finish = "stop"
                break
            if len(out) < params.max_tokens:
                logits = cache.decode([session], [token])[0]
        decode_s = time.perf_counter() - start
        measured = session.state.cache_bytes()
    except BaseException:
        cache.abort(session)
        raise
    cache.finish(session)
    return GenerateResult(ids.numel(), out, finish, prefill_s, decode_s, measured, session.provenance)
