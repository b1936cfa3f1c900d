"""SWA-pool put/get: throughput (GB/s) and latency (p50/p99) of the in-process, Redis and Mooncake pools, one value
at a time and in batches, next to a plain memory copy and each store's own client, measured in the same run.

Value sizes (bytes): a V4.1-Flash 64-token block of global KV (56,960 B: 890 B/token, `kvdiet.cache.spec`); the
real V4.1-Flash window state, 2,703,360 B per request (40 layers × 128 entries × 528 B); and a real v4.1-mini
window snapshot (`snapshot_bytes` of a fresh v4.1-mini request state: rings, positions, compressor tails,
Engram history, header). Backends, one client thread each:

- ``memory copy``: ``bytearray(value)`` in, ``bytes(held)`` out (the floor: one copy each way, this process);
- ``in-process``: `InProcessSwaPool` (a dict under a lock; an immutable ``bytes`` value is kept, not copied,
  so its GB/s is the cost of a dict operation, not of a copy);
- ``redis (kvdiet)``: `RedisSwaPool` (1 MiB chunks + a manifest in one MULTI/EXEC per put; two pipelined
  round trips per get, the CRC-32 checked; a batch of puts is one put after another);
- ``redis-py``: plain ``SET key value PX ttl`` / ``GET key`` (batched: one pipeline of SETs, one ``MGET``);
- ``redis-benchmark``: Redis's own C client (``-t set,get -d SIZE -c 1 -n N --csv``), one at a time, when
  installed; its GB/s is requests/s × size;
- ``mooncake (kvdiet)``: `MooncakeSwaPool` (header + payload by ``upsert_parts``, CRC-32; a get is ``get_size``
  per key then one ``batch_get_into``, CRC checked; a batch of puts is one put after another);
- ``mooncake-py``: the same client's ``upsert`` / ``get`` (batched: ``upsert_batch`` / ``get_batch``);
- ``global pool (kvdiet)``, 64-token blocks only: `MooncakeGlobalPool` (``--global-pool``) on the same master: each
  block a whole persistent entry (JSON header with the 64 token ids, CRC-32) behind the Mooncake header, checked
  back on every read (identity, key, token ids); a single value is a batch of one.

Each figure: distinct keys, every value put then every value read, after an untimed warm-up; batches of
``--batch`` keys (default 16); latencies are per call (one value or one batch); GB/s = value bytes moved /
wall time (GB = 1e9 B). Fixed seed. Starts its own ``redis-server`` and ``mooncake_master`` on free loopback
ports (the Mooncake pool contributes the 1 GiB segment the values live in; this process reads and writes its
own memory through Mooncake's TCP transport) unless ``--redis-url`` / ``--mooncake-url`` are given; skips
Mooncake when the ``kvdiet[mooncake]`` extra is not installed. Prints a table, then one JSON line.

    python benchmarks/bench_swa_pool.py
    python benchmarks/bench_swa_pool.py --redis-url redis://127.0.0.1:6379/0 --total-mb 64
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import redis
from rich.console import Console
from rich.table import Table

from kvdiet.cache.spec import CacheSpec
from kvdiet.cli import ArgumentParser
from kvdiet.config import load_config
from kvdiet.storage.redis_pool import RedisSwaPool
from kvdiet.storage.swa_pool import InProcessSwaPool

SEED = 0
TTL_S = 600.0
SEGMENT_BYTES = 1 << 30
LOCAL_BUFFER_BYTES = 64 << 20  # a batch of 16 window states (43 MB) through get_batch fits


def mini_snapshot_bytes() -> int:
    """Bytes of a real v4.1-mini window snapshot (a fresh request state: every buffer is full size)."""
    from kvdiet.model.build import load_model
    from kvdiet.model.snapshot import snapshot_bytes

    model, _ = load_model("v4.1-mini", seed=SEED)
    state = model.new_state(model.new_pool(1, block_size=64))
    return len(snapshot_bytes(state, bytes(32)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, what: str) -> None:
    for _ in range(400):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.025)
    raise SystemExit(f"{what} did not start on port {port}")


@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """``url``, or a fresh ``redis-server`` on a free loopback port (stopped on exit)."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server) and no --redis-url")
    port = free_port()
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
            wait_for_port(port, proc, "redis-server")
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


@contextmanager
def mooncake_master(url: str | None) -> Iterator[str | None]:
    """``url``, or a fresh ``mooncake_master`` on a free loopback port (stopped on exit); None without the
    ``mooncake`` package."""
    if url is not None:
        yield url
        return
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        yield None
        return
    binary = str(Path(next(iter(spec.submodule_search_locations))) / "mooncake_master")
    port = free_port()
    cmd = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--enable_http_metadata_server=false"]
    cmd += ["--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc, "mooncake_master")
        yield f"mooncake://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def figures(size: int, values: int, wall: float, lat: list[float]) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
    return {"gb_s": size * values / wall / 1e9, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


def measure(put: Callable, get: Callable, value: bytes, ops: int, batch: int) -> dict[str, dict]:
    """Put ``ops`` distinct keys, ``batch`` per call (``put(keys, value)``, ``get(keys) -> values``), then get
    them; a warm-up call of each first (not timed). Raises SystemExit when a read returns other bytes."""
    tag = uuid.uuid4().hex[:8].encode()
    warm = [b"warm-%s-%d" % (tag, i) for i in range(batch)]
    put(warm, value)
    get(warm)
    keys = [b"k-%s-%d" % (tag, i) for i in range(ops)]
    calls = [keys[i : i + batch] for i in range(0, ops, batch)]
    got: list[object] = []
    lat: dict[str, list[float]] = {"put": [], "get": []}
    wall: dict[str, float] = {}
    for op, fn in (("put", lambda ks: put(ks, value)), ("get", lambda ks: got.extend(get(ks)))):
        start = time.perf_counter()
        for ks in calls:
            t = time.perf_counter()
            fn(ks)
            lat[op].append(time.perf_counter() - t)
        wall[op] = time.perf_counter() - start
    if not all(g == value for g in got) or len(got) != ops:
        raise SystemExit("a read returned other bytes than were written")
    return {op: figures(len(value), ops, wall[op], lat[op]) for op in ("put", "get")}


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
            "gb_s": float(r["rps"]) * size / 1e9,
            "p50_ms": float(r["p50_latency_ms"]),
            "p99_ms": float(r["p99_latency_ms"]),
        }
        for op, r in rows.items()
    }


def backends(
    mem: InProcessSwaPool, raw: redis.Redis, rpool: RedisSwaPool, mpool, held: dict, gpool=None
) -> dict[str, tuple[Callable, Callable]]:
    """Each backend's batched ``put(keys, value)`` and ``get(keys)`` (a batch of one is a single call); the
    global pool's keys are 32-byte hashes of the bench's keys, its token ids ``0 … block_size − 1``."""

    def pool_ops(p) -> tuple[Callable, Callable]:
        def put(ks, v):
            return p.put(ks[0], v) if len(ks) == 1 else p.put_many([(k, None, v) for k in ks])

        def get(ks):
            return [p.get(ks[0])] if len(ks) == 1 else p.get_many(ks)

        return put, get

    def copy_put(ks, v):
        for k in ks:
            held[k] = bytearray(v)

    def redis_put(ks, v):
        if len(ks) == 1:
            return raw.set(b"raw:" + ks[0], v, px=int(TTL_S * 1000))
        pipe = raw.pipeline(transaction=False)
        for k in ks:
            pipe.set(b"raw:" + k, v, px=int(TTL_S * 1000))
        return pipe.execute()

    out = {
        "memory copy": (copy_put, lambda ks: [bytes(held[k]) for k in ks]),
        "in-process": pool_ops(mem),
        "redis (kvdiet)": pool_ops(rpool),
        "redis-py": (
            redis_put,
            lambda ks: [raw.get(b"raw:" + ks[0])] if len(ks) == 1 else raw.mget([b"raw:" + k for k in ks]),
        ),
    }
    if mpool is not None:
        store = mpool._conn.store  # the pool's own client: the same connection, the same segment
        names = lambda ks: ["raw:" + k.decode() for k in ks]  # noqa: E731
        out["mooncake (kvdiet)"] = pool_ops(mpool)
        out["mooncake-py"] = (
            lambda ks, v: (
                store.upsert(names(ks)[0], v)
                if len(ks) == 1
                else store.upsert_batch(names(ks), [v] * len(ks))
            ),
            lambda ks: [store.get(names(ks)[0])] if len(ks) == 1 else store.get_batch(names(ks)),
        )
    if gpool is not None:
        tokens = list(range(gpool.identity.block_size))

        def hashed(ks):
            return [hashlib.blake2b(k, digest_size=32).digest() for k in ks]

        out["global pool (kvdiet)"] = (
            lambda ks, v: gpool.put_many([(k, tokens, v) for k in hashed(ks)]),
            lambda ks: gpool.get_many(hashed(ks), [tokens] * len(ks)),
        )
    return out


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: start a redis-server here)")
    parser.add_argument("--mooncake-url", help="an existing mooncake_master (default: start one here)")
    parser.add_argument(
        "--total-mb", type=float, default=256.0, help="MB moved per size, backend and direction"
    )
    parser.add_argument("--min-ops", type=int, default=48, help="fewest values per size (default 48)")
    parser.add_argument("--max-ops", type=int, default=2048, help="most values per size (default 2048)")
    parser.add_argument("--batch", type=int, default=16, help="values per batched call (default 16)")
    args = parser.parse_args()
    rng = random.Random(SEED)
    spec = CacheSpec.from_config(load_config("deepseek-v4.1-flash"))
    sizes = {
        "V4.1-Flash 64-token block": spec.global_bytes(64),
        "V4.1-Flash window state": spec.window_bytes_per_request,
        "v4.1-mini snapshot": mini_snapshot_bytes(),
    }
    results: dict[str, dict] = {}
    errors: dict[str, int] = {}
    with redis_server(args.redis_url) as rurl, mooncake_master(args.mooncake_url) as murl:
        raw = redis.Redis.from_url(rurl)
        rpool = RedisSwaPool(rurl, namespace=f"bench-{uuid.uuid4().hex}", ttl_s=TTL_S)
        rpool.open()
        mpool = gpool = None
        if murl is not None:
            from kvdiet.storage.mooncake_pool import MooncakeSwaPool

            mpool = MooncakeSwaPool(
                murl,
                namespace=f"bench-{uuid.uuid4().hex}",
                ttl_s=TTL_S,
                segment_bytes=SEGMENT_BYTES,
                local_buffer_bytes=LOCAL_BUFFER_BYTES,
            )
            mpool.open()
            from kvdiet.storage.entry import StoreIdentity
            from kvdiet.storage.mooncake_global import MooncakeGlobalPool

            identity = StoreIdentity(uuid.uuid4().hex, ("fp4_e2m1_e4m3x16", "mxfp4"), 64)
            gpool = MooncakeGlobalPool(
                murl, identity=identity, ttl_s=TTL_S, segment_bytes=0, local_buffer_bytes=LOCAL_BUFFER_BYTES
            )
            gpool.open()
        for label, size in sizes.items():
            value = rng.randbytes(size)
            ops = max(args.min_ops, min(args.max_ops, int(args.total_mb * 1e6 / size)))
            ops -= ops % args.batch
            if mpool is not None:
                ops = min(ops, int(0.4 * SEGMENT_BYTES / (size + 64)) // args.batch * args.batch)
            held: dict[bytes, bytearray] = {}
            mem = InProcessSwaPool(2 * (ops + args.batch) * size + (64 << 20), ttl_s=TTL_S)
            r: dict[str, object] = {"bytes": size, "ops": ops}
            blocks = gpool if mpool is not None and label == "V4.1-Flash 64-token block" else None
            for backend, (put, get) in backends(mem, raw, rpool, mpool, held, blocks).items():
                for batch in (1, args.batch):
                    r.setdefault(backend, {})[str(batch)] = measure(put, get, value, ops, batch)
                    held.clear()
                    if mpool is not None:
                        mpool._conn.store.remove_all(True)  # keep the segment from filling up
            mem.close()
            for pattern in ("raw:k-*", "raw:warm-*", f"kvdiet:swa:{{{rpool.namespace}:*"):  # ours only
                keys = list(raw.scan_iter(match=pattern, count=1000))
                for i in range(0, len(keys), 500):
                    raw.unlink(*keys[i : i + 500])
            if (bench := redis_benchmark(rurl, size, ops)) is not None:
                r["redis-benchmark"] = {"1": bench}
            results[label] = r
        errors["redis"] = rpool.counters.backend_errors
        rpool.close()
        raw.close()
        if mpool is not None:
            errors["mooncake"] = mpool.counters.backend_errors + mpool.counters.write_errors
            errors["global pool"] = sum(
                getattr(gpool.counters, k) for k in ("backend_errors", "write_errors", "corrupt_dropped")
            )
            gpool.close()
            mpool.close()

    table = Table(title=f"SWA pool, one client, {os.cpu_count()} CPUs (GB = 1e9 B; latency per call)")
    for col in (
        "value",
        "backend",
        "batch",
        "put GB/s",
        "put p50 ms",
        "put p99 ms",
        "get GB/s",
        "get p50 ms",
        "get p99 ms",
    ):
        table.add_column(col, justify="right" if col == "batch" or "GB" in col or "ms" in col else "left")
    for label, r in results.items():
        for backend, by_batch in r.items():
            if backend in ("bytes", "ops"):
                continue
            for batch, f in by_batch.items():
                cells = [f"{f[d][k]:.3f}" for d in ("put", "get") for k in ("gb_s", "p50_ms", "p99_ms")]
                table.add_row(f"{label} ({r['bytes']:,} B, {r['ops']} values)", backend, batch, *cells)
    Console(width=160).print(table)
    summary = {
        "bench": "swa_pool",
        "seed": SEED,
        "batch": args.batch,
        "redis_url": "own redis-server" if args.redis_url is None else args.redis_url,
        "mooncake_url": "own mooncake_master" if args.mooncake_url is None else args.mooncake_url,
        "errors": errors,
        "sizes": {
            label: {
                k: v
                if k in ("bytes", "ops")
                else {
                    b: {d: {m: round(x, 4) for m, x in f.items()} for d, f in fb.items()}
                    for b, fb in v.items()
                }
                for k, v in r.items()
            }
            for label, r in results.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
