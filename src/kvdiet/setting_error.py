"""`SettingError`: a bad engine setting, named the way the caller spells it.

`kvdiet.LLM`, `EngineArgs`, `CacheOptions` and `SchedulerConfig` take keywords (``max_model_len``,
``numerics="bf16"``); ``kvdiet generate`` and ``kvdiet serve`` take flags (``--max-model-len``,
``--numerics bf16``). The check is written once, naming settings by field in braces; ``str(exc)`` spells them
as keywords and `SettingError.as_flags` as flags, which the command line reports (`kvdiet.cli.main`). The
values a message echoes (a folder, a policy string, a parser's complaint) are given apart from the template,
as keywords, so text in them that looks like a setting (``/tmp/{max_model_len}``) is never read as one.
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
    """A setting refused, its message a template naming settings as ``{field}`` or ``{field=value}``, and the
    values it echoes as keywords.

    In ``template``: ``{field}`` is a setting; ``{field=text}`` a setting at the constant ``text``; ``{field=}``
    a setting at ``values[field]``; ``{name}`` with ``name`` in ``values`` is that value's ``str()``, verbatim
    (name values apart from the settings the template spells: ``got``, ``limit``). Only the template is
    read for braces: a value is inserted as it is, whatever it holds. ``str()`` (Python): ``{max_model_len}`` →
    ``max_model_len``, ``{numerics=bf16}`` → ``numerics='bf16'``. `as_flags` (command line):
    ``--max-model-len``, ``--numerics bf16``.

        SettingError("{persistent_dir} must name a folder, got {got}", got=repr(folder))
        SettingError("{device=}: torch sees no CUDA device", device=name)

    Attributes:
        template: the message with its settings (and its values' places) in braces.
        values: the values it echoes, by name.
    Raises:
        KeyError: a ``{field=}`` whose value is not in ``values`` (a bug in the caller).
    """

    def __init__(self, template: str, /, **values: object) -> None:
        self.template, self.values = template, values
        super().__init__(self._render(flags=False))

    def as_flags(self) -> str:
        """The message with every setting spelled as its command-line flag."""
        return self._render(flags=True)

    def _render(self, *, flags: bool) -> str:
        def one(m: re.Match[str]) -> str:
            name, value = m[1], m[2]
            if value is None and name in self.values:
                return str(self.values[name])
            if value == "":
                value = str(self.values[name])
            if flags:
                return flag_name(name) if value is None else f"{flag_name(name)} {value}"
            return name if value is None else f"{name}={value!r}"

        return _FIELD.sub(one, self.template)  # one pass: what a value inserts is not read again


class ConfigSettingError(SettingError, ConfigError):
    """A model or checkpoint that cannot run with a setting (a `ConfigError` too), named as `SettingError`."""
