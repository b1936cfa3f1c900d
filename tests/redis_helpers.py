"""Real ``redis-server`` processes for the tests: on a free loopback port, no persistence, always stopped.

Not a test module. A missing ``redis-server`` fails the test that needs it (``tests/system-deps.sh``, the first
step of the README's test command, installs it with apt-get); nothing is skipped.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_port() -> int:
    """A free port ≤ 55535 whose cluster-bus port (+10000) is free too (a cluster node needs both)."""
    for _ in range(200):
        port = free_port()
        if port <= 55535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def ping(port: int, timeout: float = 0.2) -> bool:
    """Whether a Redis server answers PING on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` bound to 127.0.0.1 with ``save ''`` and ``appendonly no``, in ``directory``.

    `start` waits until it answers PING (10 s at most); `stop` kills it (idempotent); `restart` brings it
    back on the same port, empty. Extra server options go in ``options`` (e.g. ``["--maxmemory", "2mb"]``).
    """

    def __init__(self, directory: Path, *, port: int | None = None, options: list[str] | None = None) -> None:
        self.directory, self.port, self.options = directory, port or free_port(), options or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (bash tests/system-deps.sh installs it)")
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(self.directory), "--protected-mode", "yes", *self.options]
        log = open(self.directory / f"redis-{self.port}.log", "ab")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10.0
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = (self.directory / f"redis-{self.port}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{text}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: like a crash) and wait for it; the port is free afterwards."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
