"""``--swa-pool`` / ``--global-pool`` Mooncake URLs: ``mooncake://HOST[:PORT][?local_host=ADDR]`` parsed and checked
into a `MooncakeUrl`, before any I/O. Knows nothing of the tiers' keys or values (`kvdiet.storage.mooncake_tier`)
and imports nothing of Mooncake (the ``kvdiet[mooncake]`` extra is optional).
"""

from __future__ import annotations

import importlib.util
import ipaddress
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "DEFAULT_MASTER_PORT",
    "SCHEME",
    "MooncakeUrl",
    "check_mooncake_spec",
    "is_mooncake_url",
    "parse_mooncake_url",
]

SCHEME = "mooncake"
DEFAULT_MASTER_PORT = 50051
"""``mooncake_master``'s default ``--rpc_port``."""


@dataclass(frozen=True, slots=True)
class MooncakeUrl:
    """A checked Mooncake URL.

    Attributes:
        host / port: the ``mooncake_master`` RPC address.
        local_host: the address other clients reach this process's segment at (``?local_host=``; None: the
            address this machine uses to reach the master, found when the pool opens).
    """

    host: str
    port: int
    local_host: str | None = None

    @property
    def master(self) -> str:
        """``HOST:PORT`` as Mooncake's client takes it (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        query = f"?local_host={self.local_host}" if self.local_host else ""
        return f"{SCHEME}://{self.master}{query}"


def is_mooncake_url(spec: str) -> bool:
    """Whether ``spec`` names the Mooncake backend (its scheme; checked by `parse_mooncake_url`)."""
    return spec.strip().lower().startswith(f"{SCHEME}://")


def parse_mooncake_url(spec: str, *, flag: str = "--swa-pool") -> MooncakeUrl:
    """The `MooncakeUrl` of ``mooncake://HOST[:PORT][?local_host=ADDR]`` (port 50051 by default); errors name
    ``flag``.

    Raises:
        ValueError: another scheme, no host, a port outside 1–65535, a path, user info or fragment, a query
            other than one ``local_host``, or a ``local_host`` that is not an IP address.
    """
    text = spec.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{flag}: bad Mooncake URL {text!r}: {exc}") from None
    if parts.scheme.lower() != SCHEME:
        raise ValueError(f"{flag}: {text!r} is not a Mooncake URL (mooncake://HOST[:PORT])")
    if not parts.hostname:
        raise ValueError(f"{flag}: {text!r} names no master host (mooncake://HOST[:PORT])")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{flag}: port {port} of {text!r} is outside 1-65535")
    if parts.path not in ("", "/") or parts.username or parts.password or parts.fragment:
        raise ValueError(f"{flag}: {text!r}: a Mooncake URL has no path, user or fragment")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - {"local_host"})
    if unknown:
        raise ValueError(f"{flag}: unknown option {', '.join(unknown)} in {text!r} (only local_host)")
    local = query.get("local_host", [None])
    if len(local) > 1:
        raise ValueError(f"{flag}: local_host is given twice in {text!r}")
    if local[0] is not None:
        try:
            ipaddress.ip_address(local[0])
        except ValueError:
            raise ValueError(f"{flag}: local_host={local[0]!r} in {text!r} is not an IP address") from None
    return MooncakeUrl(parts.hostname, port or DEFAULT_MASTER_PORT, local[0])


def check_mooncake_spec(spec: str, *, flag: str) -> str:
    """``spec`` (stripped) when it is a good Mooncake URL (`parse_mooncake_url`) and the ``mooncake`` package is
    installed (looked up, not imported).

    Raises:
        ValueError naming ``flag``: a bad URL, or no ``mooncake`` package (the ``kvdiet[mooncake]`` extra).
    """
    parse_mooncake_url(spec, flag=flag)
    if importlib.util.find_spec("mooncake") is None:
        raise ValueError(
            f"{flag}: a Mooncake tier needs the mooncake package: pip install 'kvdiet[mooncake]' "
            "(and the system library libibverbs1)"
        )
    return spec.strip()
