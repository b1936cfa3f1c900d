"""Real Mooncake Store processes for the tests: a ``mooncake_master`` and a standalone ``mooncake_client`` (a
segment holder) on free loopback ports, always stopped; and a raw client to look at and damage values.

Not a test module. A missing ``mooncake`` package or ``libibverbs.so.1`` fails the test that needs it (the
README's test command installs both: ``tests/system-deps.sh`` and the ``mooncake`` extra); nothing is skipped.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_helpers import free_port


def _binary(name: str) -> str:
    """The path of ``name`` inside the installed ``mooncake`` package (what its console scripts exec)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the mooncake package is not installed (pip install -e '.[dev,mooncake]')")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.exists():
        pytest.fail(f"{path} is missing from the mooncake package")
    return str(path)


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class _Process:
    """A child process logging to ``directory``; `stop` kills it (SIGKILL: like a crash) and waits."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory, self.port = directory, port
        self.proc: subprocess.Popen | None = None

    def _spawn(self, cmd: list[str], name: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log = self.directory / f"{name}-{self.port}.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def _wait_for(self, ready, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class MooncakeMaster(_Process):
    """One ``mooncake_master`` on 127.0.0.1: RPC on ``port``, metrics on another free loopback port, no HTTP
    metadata server (clients use P2P handshakes). `start` waits until the RPC port accepts (20 s at most);
    `restart` brings it back on the same port, knowing no keys. Extra flags go in ``options``."""

    def __init__(self, directory: Path, *, port: int | None = None, options: list[str] | None = None) -> None:
        super().__init__(directory, port or free_port())
        self.options = options or []

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self) -> MooncakeMaster:
        cmd = [_binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}"]
        cmd += ["--enable_http_metadata_server=false", "--metrics_host=127.0.0.1"]
        cmd += [f"--metrics_port={free_port()}", *self.options]
        self._spawn(cmd, "master")
        self._wait_for(lambda: port_open(self.port), f"mooncake_master on port {self.port}")
        return self

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SegmentHolder(_Process):
    """A standalone ``mooncake_client`` contributing ``segment_bytes`` to ``master``'s pool: the long-lived
    per-machine segment owner of the README's deployment. Its service listens on 127.0.0.1:``port``."""

    def __init__(self, directory: Path, master: MooncakeMaster, segment_bytes: int = 64 << 20) -> None:
        super().__init__(directory, free_port())
        self.master, self.segment_bytes = master, segment_bytes

    def start(self) -> SegmentHolder:
        cmd = [_binary("mooncake_client"), f"--master_server_address=127.0.0.1:{self.master.port}"]
        cmd += ["--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.segment_bytes}"]
        cmd += ["--host=127.0.0.1", f"--port={self.port}", "--protocol=tcp"]
        self._spawn(cmd, "segment")
        self._wait_for(lambda: port_open(self.port), f"mooncake_client on port {self.port}")
        return self

    def __enter__(self) -> SegmentHolder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def raw_client(master: MooncakeMaster, *, segment_bytes: int = 0):
    """A plain ``MooncakeDistributedStore`` on ``master`` (no segment by default); close it after use."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", f"127.0.0.1:{master.port}"
    )
    assert rc == 0, f"setup failed: {rc}"
    return store


def master_with_segment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A module's own master with one 64 MiB segment holder (the tiers under test contribute none); the body of
    a module-scoped ``master`` fixture."""
    d = tmp_path_factory.mktemp("mooncake")
    with MooncakeMaster(d) as m, SegmentHolder(d, m):
        yield m


def raw_client_of(master: MooncakeMaster) -> Iterator:
    """`raw_client`, closed after use; the body of a module-scoped ``raw`` fixture."""
    store = raw_client(master)
    yield store
    store.close()
