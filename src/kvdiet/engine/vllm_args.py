"""`check_vllm_only`: vLLM's arguments that kvdiet does not implement, taken only at the values that change
nothing, so code written for vLLM that spells them out runs unchanged; any other value is refused by name.

Used by `kvdiet.engine.sampling.SamplingParams` (``n=1``, ``presence_penalty=0``, …) and `kvdiet.engine.llm.LLM`
(``tensor_parallel_size=1``, ``enforce_eager``, …)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_vllm_only"]


def check_vllm_only(
    owner: str, table: Mapping[str, tuple[object, ...]], values: Mapping[str, object]
) -> None:
    """Check ``values`` (argument → value) against ``table`` (argument → the values that change nothing here).

    A value matches a listed one when it is it, or equals it and is a bool exactly when the listed one is one
    (``n=True`` is not ``n=1``; ``enforce_eager=True`` is ``True``). An argument whose tuple is empty is never
    taken.

    Raises:
        TypeError: an argument at another value, named with the words "not supported by kvdiet" and the values
            ``owner`` takes (a TypeError, as Python's own unexpected keyword would be).
    """
    for name, value in values.items():
        defaults = table[name]
        if any(
            value is d or (d is not None and isinstance(value, bool) == isinstance(d, bool) and value == d)
            for d in defaults
        ):
            continue
        accepted = " or ".join(f"{name}={d!r}" for d in defaults)
        taken = (
            f"accepts vLLM's {name} only as {accepted}, which changes nothing"
            if defaults
            else (f"does not take vLLM's {name}")
        )
        raise TypeError(f"{name}={value!r} is not supported by kvdiet: {owner} {taken}")
