"""`check_pool_specs`: the SWA-pool and global-pool backends a `CacheOptions` names, checked when `EngineArgs`
is made (here, above the storage layer that parses them: `kvdiet.cache` is below it), so a bad one is refused
before the model loads and named as the caller spells it."""

from __future__ import annotations

from kvdiet.cache.options import CacheOptions
from kvdiet.setting_error import SettingError
from kvdiet.storage.mooncake_urls import check_mooncake_spec
from kvdiet.storage.swa_pool_factory import check_swa_pool_spec

__all__ = ["check_pool_specs"]


def check_pool_specs(opts: CacheOptions) -> None:
    """``swa_pool`` and ``global_pool`` name backends (`check_swa_pool_spec`, `check_mooncake_spec`), checked when
    `EngineArgs` is made; their refusals (written with the flag, ``--swa-pool: …``) name the keyword from Python
    and the flag on the command line (`SettingError`).

    Raises:
        SettingError: a spec that names no backend (or a Mooncake one without the ``mooncake`` package).
        TypeError: a spec that is not a string (``global_pool`` may be None).
    """
    for name, flag, check in (
        ("swa_pool", "--swa-pool", check_swa_pool_spec),
        ("global_pool", "--global-pool", lambda spec: check_mooncake_spec(spec, flag="--global-pool")),
    ):
        spec = getattr(opts, name)
        if spec is None and name == "global_pool":
            continue
        if not isinstance(spec, str):
            raise TypeError(f"{name} must be a str, got {spec!r}")
        try:
            check(spec)
        except ValueError as exc:
            text = str(exc)
            said = text.removeprefix(flag) if text.startswith(f"{flag}:") else f": {text}"
            raise SettingError(f"{{{name}}}{{said}}", said=said) from None
