"""`SettingError`: a bad engine setting, named the way the caller spells it.

`kvdiet.LLM`, `EngineArgs`, `CacheOptions` and `SchedulerConfig` take keywords (``max_model_len``,
``numerics="bf16"``); ``kvdiet generate`` and ``kvdiet serve`` take flags (``--max-model-len``,
``--numerics bf16``). The check is written once, naming settings by field in braces; ``str(exc)`` spells them
as keywords and `SettingError.as_flags` as flags, which the command line reports (`kvdiet.cli.main`).
Torch-free.
"""

from __future__ import annotations

import re

from kvdiet.config_validation import ConfigError

__all__ = ["ConfigSettingError", "SettingError", "flag_name"]

_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)(?:=([^{}]*))?\}")

_FLAGS = {
    "policy": "--swa-policy",
    "persistent_ttl_s": "--persistent-ttl",
    "swa_pool_ttl_s": "--swa-pool-ttl",
    "global_pool_ttl_s": "--global-pool-ttl",
    "expert_cache_bytes": "--expert-cache-size",
}
"""Fields whose flag is not ``--`` and the field with dashes (`CacheOptions.policy` is ``--swa-policy``; the TTLs'
flags take durations, so they drop the ``_s``)."""


def flag_name(field: str) -> str:
    """The command-line flag of an engine setting: ``max_model_len`` → ``--max-model-len``."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


class SettingError(ValueError):
    """A setting refused, its message a template naming settings as ``{field}`` or ``{field=value}``.

    ``str()`` (Python): ``{max_model_len}`` → ``max_model_len``, ``{numerics=bf16}`` → ``numerics='bf16'``.
    `as_flags` (command line): ``--max-model-len``, ``--numerics bf16``.

    Attributes:
        template: the message with its settings in braces.
    """

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(_FIELD.sub(_keyword, template))

    def as_flags(self) -> str:
        """The message with every setting spelled as its command-line flag."""
        return _FIELD.sub(_flag, self.template)


class ConfigSettingError(SettingError, ConfigError):
    """A model or checkpoint that cannot run with a setting (a `ConfigError` too), named as `SettingError`."""


def _keyword(m: re.Match[str]) -> str:
    return m[1] if m[2] is None else f"{m[1]}={m[2]!r}"


def _flag(m: re.Match[str]) -> str:
    return flag_name(m[1]) if m[2] is None else f"{flag_name(m[1])} {m[2]}"
