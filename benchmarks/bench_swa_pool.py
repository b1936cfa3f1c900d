"""SWA-pool snapshot put/get: throughput (MB/s) and latency (p50/p99) of the in-process pool and the Redis pool,
next to raw Redis SET/GET of the same bytes measured in the same run (the floor Redis itself sets).

Value sizes (bytes): 64 KiB; the real V4.1-Flash window state, 2,703,360 B per request (40 layers × 128
entries × 528 B, `kvdiet.cache.spec`); and a real v4.1-mini window snapshot (`snapshot_bytes` of a fresh
v4.1-mini request state: the rings plus their positions, the compressor tails, the Engram history and the
header). Backends, one client thread each, one operation at a time:

- ``in-process``: `InProcessSwaPool` (a dict under a lock; an immutable ``bytes`` value is kept, not copied, so
  its MB/s is the cost of a dict operation, not of a copy);
- ``redis (kvdiet)``: `RedisSwaPool` (1 MiB chunks + a manifest in one MULTI/EXEC per put; two pipelined
  round trips per get, the CRC-32 checked);
- ``redis-py SET/GET``: one plain ``SET key value PX ttl`` / ``GET key`` of the whole value through redis-py;
- ``redis-benchmark``: Redis's own C client (``redis-benchmark -t set,get -d SIZE -c 1 -n N --csv``), when
  installed; its MB/s is requests/s × size.

Each figure: distinct keys, every value put then every value read, after an untimed warm-up; MB/s = value
bytes moved / wall time (MB = 1e6 B). Fixed seed. Starts its own ``redis-server`` on a free loopback port
(persistence off, ``maxmemory`` 2 GB, allkeys-lru) unless ``--redis-url`` is given (then it removes the keys
it wrote after each size; ``redis-benchmark`` leaves its one ``key:__rand_int__``). Prints a table, then one
JSON line.

    python benchmarks/bench_swa_pool.py
    python benchmarks/bench_swa_pool.py --redis-url redis://127.0.0.1:6379/0 --total-mb 64
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from urllib.parse import urlsplit

import redis
from rich.console import Console
from rich.table import Table

from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config
from kvdiet.storage.redis_pool import RedisSwaPool
from kvdiet.storage.swa_pool import InProcessSwaPool

SEED = 0
TTL_S = 600.0


def mini_snapshot_bytes() -> int:
    """Bytes of a real v4.1-mini window snapshot (a fresh request state: every buffer is full size)."""
    from kvdiet.model.build import load_model
    from kvdiet.model.snapshot import snapshot_bytes

    model, _ = load_model("v4.1-mini", seed=SEED)
    state = model.new_state(model.new_pool(1, block_size=64))
    return len(snapshot_bytes(state, bytes(32)))


@contextmanager
def redis_server(url: str | None):
    """``url``, or a fresh ``redis-server`` on a free loopback port (stopped on exit)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server) and no --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += [
            "--dir",
            d,
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
            "--logfile",
            f"{d}/log",
        ]
        proc = subprocess.Popen(cmd)
        try:
            client = redis.Redis(port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.025)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def timed(op: Callable[[bytes], object], keys: list[bytes]) -> tuple[float, list[float]]:
    """Wall seconds of ``op`` over every key, and each call's seconds."""
    lat = []
    start = time.perf_counter()
    for k in keys:
        t = time.perf_counter()
        op(k)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def figures(size: int, ops: int, wall: float, lat: list[float]) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"mb_s": size * ops / wall / 1e6, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


def measure(put: Callable, get: Callable, value: bytes, ops: int, check: bool) -> dict[str, dict]:
    """Put ``ops`` distinct keys, then get them; a warm-up of a few keys first (not timed)."""
    tag = uuid.uuid4().hex[:8].encode()
    for i in range(min(5, ops)):
        put(b"warm-%s-%d" % (tag, i), value)
        get(b"warm-%s-%d" % (tag, i))
    keys = [b"k-%s-%d" % (tag, i) for i in range(ops)]
    put_wall, put_lat = timed(lambda k: put(k, value), keys)
    got: list[object] = []
    get_wall, get_lat = timed(lambda k: got.append(get(k)), keys)
    if check and not all(g == value for g in got):
        raise SystemExit("a read returned other bytes than were written")
    return {
        "put": figures(len(value), ops, put_wall, put_lat),
        "get": figures(len(value), ops, get_wall, get_lat),
    }


def redis_benchmark(url: str, size: int, ops: int) -> dict[str, dict] | None:
    """``redis-benchmark`` SET and GET of ``size`` bytes, one client, ``ops`` requests each; None if absent."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    parts = urlsplit(url)
    cmd = [binary, "-h", parts.hostname, "-p", str(parts.port or 6379), "-t", "set,get", "-n", str(ops)]
    out = subprocess.run(
        [*cmd, "-d", str(size), "-c", "1", "--csv"], capture_output=True, text=True, check=True
    )
    rows = {r["test"]: r for r in csv.DictReader(io.StringIO(out.stdout))}
    return {
        {"SET": "put", "GET": "get"}[op]: {
            "mb_s": float(r["rps"]) * size / 1e6,
            "p50_ms": float(r["p50_latency_ms"]),
            "p99_ms": float(r["p99_latency_ms"]),
        }
        for op, r in rows.items()
    }


def _batched(items, n: int):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: start a redis-server here)")
    parser.add_argument(
        "--total-mb", type=float, default=256.0, help="MB moved per size and direction (default 256)"
    )
    parser.add_argument("--min-ops", type=int, default=50, help="fewest operations per size (default 50)")
    parser.add_argument("--max-ops", type=int, default=2000, help="most operations per size (default 2000)")
    args = parser.parse_args()
    rng = random.Random(SEED)
    sizes = {
        "64 KiB": 64 << 10,
        "V4.1-Flash window state": CacheSpec.from_config(
            load_config("deepseek-v4.1-flash")
        ).window_bytes_per_request,
        "v4.1-mini snapshot": mini_snapshot_bytes(),
    }
    results: dict[str, dict] = {}
    with redis_server(args.redis_url) as url:
        raw = redis.Redis.from_url(url)
        pool = RedisSwaPool(url, namespace=f"bench-{uuid.uuid4().hex}", ttl_s=TTL_S)
        pool.open()
        for label, size in sizes.items():
            value = rng.randbytes(size)
            ops = max(args.min_ops, min(args.max_ops, int(args.total_mb * 1e6 / size)))
            mem = InProcessSwaPool(2 * ops * size + (64 << 20), ttl_s=TTL_S)
            r = {
                "bytes": size,
                "ops": ops,
                "in-process": measure(mem.put, mem.get, value, ops, True),
                "redis (kvdiet)": measure(pool.put, pool.get, value, ops, True),
                "redis-py SET/GET": measure(
                    lambda k, v: raw.set(b"raw:" + k, v, px=int(TTL_S * 1000)),
                    lambda k: raw.get(b"raw:" + k),
                    value,
                    ops,
                    True,
                ),
            }
            for pattern in ("raw:k-*", "raw:warm-*", f"kvdiet:swa:{{{pool.namespace}:*"):  # ours only
                for batch in _batched(raw.scan_iter(match=pattern, count=1000), 500):
                    raw.unlink(*batch)
            if (bench := redis_benchmark(url, size, ops)) is not None:
                r["redis-benchmark"] = bench
            results[label] = r
            mem.close()
        errors = pool.counters.backend_errors
        pool.close()
        raw.close()

    table = Table(title=f"SWA pool, one client, {os.cpu_count()} CPUs (MB = 1e6 B)")
    for col in (
        "value",
        "backend",
        "put MB/s",
        "put p50 ms",
        "put p99 ms",
        "get MB/s",
        "get p50 ms",
        "get p99 ms",
    ):
        table.add_column(col, justify="right" if "MB" in col or "ms" in col else "left")
    for label, r in results.items():
        for backend, f in r.items():
            if backend in ("bytes", "ops"):
                continue
            cells = [
                f"{f[d][k]:,.1f}" if k == "mb_s" else f"{f[d][k]:.3f}" for d in ("put", "get") for k in f[d]
            ]
            table.add_row(f"{label} ({r['bytes']:,} B, {r['ops']} ops)", backend, *cells)
    Console(width=140).print(table)
    summary = {
        "bench": "swa_pool",
        "seed": SEED,
        "redis_url": "own redis-server" if args.redis_url is None else args.redis_url,
        "backend_errors": errors,
        "sizes": {
            label: {
                k: v
                if k in ("bytes", "ops")
                else {d: {m: round(x, 3) for m, x in f.items()} for d, f in v.items()}
                for k, v in r.items()
            }
            for label, r in results.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
