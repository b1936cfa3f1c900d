"""One Mooncake Store client as a Mooncake tier sees it (`kvdiet.storage.mooncake_tier`): its set-up (a TCP
check of the master's port, then ``setup`` with P2P handshakes over TCP and this process's segment), its health,
the back-off after a failure and the warnings (at most one a minute). Counts failures in the tier's counters.

Mooncake is imported at the first connection, not here (the ``kvdiet[mooncake]`` extra is optional): a missing
package or ``libibverbs.so.1`` is a failure like a dead master. Not known here: keys, values, headers.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import suppress
from typing import Any

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.mooncake_urls import MooncakeUrl

__all__ = ["UNREACHABLE", "MooncakeConnection"]

_log = logging.getLogger("kvdiet.storage.mooncake_pool")  # one logger for the lines of every Mooncake tier
UNREACHABLE = frozenset({-900, -901})
"""RPC_FAIL, RPC_TIMEOUT (mooncake-store ``include/types.h`` ``ErrorCode``): the master did not answer."""
_WARN_EVERY_S = 60.0


class MooncakeConnection:
    """The client of one tier. ``segment_bytes`` / ``local_buffer_bytes``: this process's contribution to the
    pool and its staging buffer (bytes); ``backoff_s``: seconds the master is skipped after it failed to
    answer; ``connect_timeout_s``: seconds the TCP check may take. Failures go to ``counters`` under ``lock``
    (the tier's); warnings name the tier (``label``, e.g. ``"SWA pool"``) and what a miss costs (``fallback``).
    No I/O until `connect` or `client`."""

    def __init__(
        self,
        url: MooncakeUrl,
        *,
        segment_bytes: int,
        local_buffer_bytes: int,
        backoff_s: float,
        connect_timeout_s: float,
        counters: TierCounters,
        lock: threading.Lock,
        label: str,
        fallback: str,
    ) -> None:
        self.label, self.fallback = label, fallback
        self.url, self.segment_bytes, self.local_buffer_bytes = url, segment_bytes, local_buffer_bytes
        self.backoff_s, self.connect_timeout_s = backoff_s, connect_timeout_s
        self.counters, self._lock = counters, lock
        self.store: Any = None  # a set-up mooncake.store.MooncakeDistributedStore
        self.down = False  # the last call to the master failed
        self._down_until = 0.0  # time.monotonic() before which nothing is tried
        self._warned_at = -float("inf")

    def close(self) -> None:
        """Unmount the segment (its values leave the pool) and disconnect. Idempotent; about 2 s."""
        with self._lock:
            store, self.store = self.store, None
        if store is not None:
            with suppress(Exception):
                store.close()

    def client(self) -> Any:
        """The set-up client, or None while the master is backed off or does not answer (then one TCP connect
        to its port: a dead master makes each call of Mooncake's own take ~4.5 s)."""
        if self.down and time.monotonic() < self._down_until:
            return None
        if self.store is None:
            return self.connect(at_start=False)
        if self.down and not self._port_open():
            self.failed(ConnectionRefusedError("master port closed"), "unreachable")
            return None
        return self.store

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.url.host, self.url.port), timeout=self.connect_timeout_s):
                return True
        except OSError:
            return False

    def _local_host(self) -> str:
        """``?local_host=``, else the address this machine reaches the master from (no packet is sent)."""
        if self.url.local_host:
            return self.url.local_host
        try:
            with socket.socket(
                socket.AF_INET6 if ":" in self.url.host else socket.AF_INET, socket.SOCK_DGRAM
            ) as s:
                s.connect((self.url.host, self.url.port))
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def connect(self, *, at_start: bool) -> Any:
        """Set up a client (``P2PHANDSHAKE``, TCP) and mount the segment; None on failure (counted, warned,
        backed off). Checks the master's port first: Mooncake's ``setup`` waits ~90 s for a dead master."""
        what = "unreachable at start-up" if at_start else "cannot connect"
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as exc:  # no extra, or no libibverbs.so.1
            self.failed(exc, f"{what}: Mooncake unavailable (pip install 'kvdiet[mooncake]'; libibverbs1)")
            return None
        if not self._port_open():
            self.failed(ConnectionRefusedError(f"nothing answers at {self.url.master}"), what)
            return None
        store = MooncakeDistributedStore()
        rc = store.setup(
            self._local_host(),
            "P2PHANDSHAKE",
            self.segment_bytes,
            self.local_buffer_bytes,
            "tcp",
            "",
            self.url.master,
        )
        if rc != 0:
            with suppress(Exception):
                store.close()
            self.failed(-900 if rc == -1 else rc, what)
            return None
        with self._lock:
            self.store = store
        self.succeeded()
        return store

    def failed(self, err: int | BaseException, what: str, *, write: bool = False) -> None:
        """Count a failed call; back the master off when it did not answer (an RPC failure or no connection)."""
        now = time.monotonic()
        unreachable = isinstance(err, OSError | ImportError) or err in UNREACHABLE
        with self._lock:
            self.counters.backend_errors += 1
            if write:
                self.counters.write_errors += 1
            if unreachable:
                self.down, self._down_until = True, now + self.backoff_s
            warn = now - self._warned_at >= _WARN_EVERY_S
            if warn:
                self._warned_at = now
        detail = f"error {err}" if isinstance(err, int) else (str(err).strip() or type(err).__name__)
        msg = "%s %s: %s (%s); %s"
        args: tuple = (self.label, self.url, what, detail, self.fallback)
        if unreachable:
            msg += "; retrying every %g s"
            args += (self.backoff_s,)
        _log.log(logging.WARNING if warn else logging.DEBUG, msg, *args)

    def succeeded(self) -> None:
        """Mark the master answering again (an info line when it was down)."""
        if self.down:
            with self._lock:
                was_down, self.down = self.down, False
            if was_down:
                _log.info("%s %s: reachable again", self.label, self.url)
