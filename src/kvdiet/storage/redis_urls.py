"""``--swa-pool`` Redis URLs: parsing and checking them (`parse_redis_urls`), the server identity every
process hashes keys against (`server_id`), and URLs with their password hidden for logs (`redact_url`).
Knows nothing of the pool's keys or values (`kvdiet.storage.redis_pool`).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import redis

__all__ = ["parse_redis_urls", "redact_url", "server_id"]

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_URL_OPTIONS = {  # query options redis-py reads from a URL (redis.connection.URL_QUERY_ARGUMENT_PARSERS) ...
    *redis.connection.URL_QUERY_ARGUMENT_PARSERS,
    *("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "client_name"),
}  # ... and the client options a rediss:// URL may carry; redis-py passes others on blindly


def parse_redis_urls(spec: str) -> tuple[str, ...]:
    """The Redis URLs of a ``--swa-pool`` value, checked: one URL or several separated by commas.

    Accepted: ``redis://[user:password@]host[:port][/db]`` (port 6379, db 0 by default), ``rediss://`` (TLS),
    ``unix:///path/to.sock[?db=N]``, and ``redis+cluster://host:port`` (a Redis Cluster, reached through
    any of its nodes; then the only URL). Raises:
        ValueError: an empty list, an unknown scheme, no host or socket path, a port outside 1–65535, a db
            that is not an integer ≥ 0 (or not 0 on a cluster), a repeated server, a cluster URL among
            others, or options redis-py rejects.
    """
    urls = tuple(u.strip() for u in spec.split(",") if u.strip())
    if not urls:
        raise ValueError(f"--swa-pool: no Redis URL in {spec!r}")
    seen: set[str] = set()
    for url in urls:
        name = server_id(url)
        if name in seen:
            raise ValueError(f"--swa-pool: {redact_url(url)} is listed twice")
        seen.add(name)
    if len(urls) > 1 and any("+cluster" in urlsplit(u).scheme for u in urls):
        raise ValueError(
            "--swa-pool: a redis+cluster:// URL must be the only one (the cluster shards itself)"
        )
    return urls


def server_id(url: str) -> str:
    """``scheme://host:port/db`` (or the socket path) of ``url``: what every process hashes keys against.
    Raises ValueError on a bad URL (see `parse_redis_urls`)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--swa-pool: bad Redis URL {redact_url(url)!r}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"--swa-pool: {redact_url(url)!r} is not a Redis URL (schemes: {', '.join(_SCHEMES)}; "
            "or 'in-process')"
        )
    base = parts.scheme.removesuffix("+cluster")
    if base == "unix":
        if not parts.path:
            raise ValueError(f"--swa-pool: {redact_url(url)!r} names no socket path")
        where = parts.path
    else:
        if not parts.hostname:
            raise ValueError(f"--swa-pool: {redact_url(url)!r} names no host")
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"--swa-pool: port {port} of {redact_url(url)!r} is outside 1-65535")
        where = f"{parts.hostname}:{port or 6379}"
        if not re.fullmatch(r"/?[0-9]*", parts.path):
            raise ValueError(
                f"--swa-pool: db of {redact_url(url)!r} must be an integer >= 0 (redis://HOST:PORT/DB)"
            )
    try:
        options = redis.connection.parse_url(url.replace("+cluster://", "://", 1))
    except ValueError as exc:
        raise ValueError(f"--swa-pool: bad Redis URL {redact_url(url)!r}: {exc}") from None
    unknown = sorted(
        set(options) - _URL_OPTIONS - {"host", "port", "path", "username", "password", "connection_class"}
    )
    if unknown:
        raise ValueError(f"--swa-pool: unknown option {', '.join(unknown)} in {redact_url(url)!r}")
    db = options.get("db", 0)
    if "+cluster" in parts.scheme and db != 0:
        raise ValueError(f"--swa-pool: a Redis Cluster has only db 0, got {db} in {redact_url(url)!r}")
    return f"{parts.scheme}://{where}/{db}"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and the start-up report)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}"))
    except ValueError:
        return "<unparsable URL>"
