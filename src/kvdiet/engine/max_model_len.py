"""`check_max_model_len`: the longest request (prompt + output, in tokens) against the model's limit and the
device pool. `EngineArgs.validate` runs it before the model loads, `LLMEngine` again on its open pool."""

from __future__ import annotations

import operator
from numbers import Integral

from kvdiet.setting_error import SettingError
from kvdiet.units import format_bytes

__all__ = ["check_max_model_len"]


def check_max_model_len(
    max_model_len: int | None, *, limit: int, block_size: int, num_blocks: int, block_bytes: int
) -> int:
    """The longest prompt + output in tokens (``limit``, the config's ``max_position_embeddings``, when None),
    checked against ``limit`` and against a pool of ``num_blocks`` blocks of ``block_size`` tokens and
    ``block_bytes`` bytes: one request of that length must fit, in ``ceil(max_model_len / block_size)`` blocks
    (vLLM's meaning). A request never holds the KV of more tokens than that: a decode step writes the KV of
    the token sampled before it, and the last sampled token is never fed back (a request of N tokens holds
    N - 1, or N when it only scores its prompt with ``max_tokens`` 0).

    Raises:
        SettingError (a ValueError): out of ``[1, limit]``, or one request would not fit in the pool (one line,
            named as a keyword; as a flag in `SettingError.as_flags`), naming both ways out with their numbers:
            ``kv_cache_memory`` of at least ``ceil(max_model_len / block_size) * block_bytes`` bytes (the
            pool holds ``kv_cache_memory // block_bytes`` blocks, `kvdiet.engine.runner.pool_num_blocks`), or
            ``max_model_len`` of at most ``num_blocks * block_size`` tokens.
    """
    n = limit if max_model_len is None else max_model_len
    if not isinstance(n, Integral) or isinstance(n, bool):  # 8.5 or "8": one line, not a TypeError from <=
        raise SettingError(
            "{max_model_len} must be a whole number of tokens, got {got}", got=repr(max_model_len)
        )
    n = operator.index(n)  # numpy's ints too, kept as Python's int
    if not 1 <= n <= limit:
        raise SettingError(
            f"{{max_model_len}} must be in [1, {limit}] (max_position_embeddings), got {max_model_len}"
        )
    need = -(-n // block_size)
    if need > num_blocks:
        held = num_blocks * block_size
        memory = need * block_bytes
        given = "" if max_model_len is not None else f" (the default, max_position_embeddings {limit})"
        raise SettingError(
            f"one request of {{max_model_len}} {n} tokens{given} needs {need} blocks of {block_size} tokens, "
            f"but the KV cache holds {num_blocks} blocks ({held} tokens): raise {{kv_cache_memory}} to at "
            f"least {memory} bytes ({format_bytes(memory)}), or set {{max_model_len}} to at most {held}"
        )
    return n
