"""Load test of the OpenAI-compatible server (``kvdiet serve``): throughput, latency, cache hits, no leaks.

One process, two runs of the same deterministic workload (fixed seed), each on its own freshly loaded
engine with its own empty persistent-tier directory and SWA pool, so both start from the same cache state:

1. HTTP: the real app (`build_app` over an `EngineLoop`, wired as ``kvdiet serve`` wires it) under uvicorn
   in a background thread, bound to a free port on 127.0.0.1 only. ``--clients`` concurrent streaming
   clients (the official ``openai`` package, ``AsyncOpenAI``) send ``--requests`` completions with
   token-id prompts, ``temperature 0``, ``ignore_eos`` and ``--max-tokens`` each (so every output has
   exactly that many tokens). Half the prompts are fresh (random ids), half share a ``--prefix-tokens``
   prefix plus a unique ``--suffix-tokens`` suffix; fresh prompts have the same length. Measured per
   request: TTFT (request sent → first chunk carrying a token), inter-token latencies (gaps between
   token-carrying chunks, a chunk of k tokens counting k gaps of 1/k each), output tokens and the usage
   chunk's ``prompt_tokens_details`` (kvdiet's ``device_tokens``, ``persistent_tokens``,
   ``window_source``, ``replayed_tokens``). Then the leak check: once the engine is idle, the device
   pool's free-block count is back at its value before the run (cached blocks count as free) and
   ``check_integrity`` passes.
2. LLM direct (the baseline of the server overhead): the same prompts and parameters through
   ``kvdiet.LLM.generate``, all submitted at once.

HTTP runs first, then LLM; each run is preceded by one short warm-up request (excluded) on its own engine.
To make the two comparable the engine's ``--max-num-seqs`` defaults to ``--clients`` in BOTH runs: the
HTTP clients never have more than N requests in flight and ``LLM.generate`` (which submits everything) then
never runs more than N at once either. Client, server and engine share this process (and its GIL), so the
HTTP/LLM ratios include that contention as well as HTTP, JSON and SSE costs. The engine's
``--max-model-len`` defaults to the workload's prompt + ``--max-tokens`` (v4.1-mini's 1M-token default
would not fit the 256MiB device pool). Output tokens are counted from the chunks' ``token_ids``
(``return_token_ids``); a server that does not send them is counted one token per chunk (the engine emits
one output per generated token), which the JSON line flags with ``"token_ids_streamed": false``.

Reported: output throughput (output tokens / wall time of the run), TTFT and ITL p50/p99 (HTTP only: the
LLM API gives no per-token times), requests, errors (an exception, a finish reason other than ``length``
or a wrong token count), prefix-hit shares by tier (device / persistent tokens over prompt tokens), the
share of requests whose window state came from the SWA pool, replayed tokens, leaked blocks, and the
HTTP/LLM wall-time and throughput ratios. Prints a table, then one JSON line; exits 1 on errors, leaked
blocks or a failed integrity check. ``--timeout`` bounds the whole run (model loads included): at the
deadline outstanding HTTP requests are cancelled and counted as errors; an LLM run still going is aborted
and all its requests count as errors (a run not yet started is skipped), so the script always stops by
itself. Timings need an otherwise idle machine: another process competing for the cores can slow torch
many times over.

    python benchmarks/bench_serve.py        # v4.1-mini, 16 requests, 4 clients: ~5-6 min on 2 idle cores
    python benchmarks/bench_serve.py --requests 8 --prefix-tokens 256 --suffix-tokens 16 --max-tokens 4
    python benchmarks/bench_serve.py --model v4.1-micro --prefix-tokens 64 --suffix-tokens 8   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

SEED = 0
WARMUP_TOKENS = 16


# --- workload ---


def make_prompts(n: int, prefix: int, suffix: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` token-id prompts of ``prefix + suffix`` ids, fresh (even indices) and sharing one prefix (odd
    indices). Ids lie in [100, 100000) for large vocabularies, else in [1, vocab)."""
    lo, hi = id_range(vocab)
    rng = np.random.default_rng(seed)
    common = rng.integers(lo, hi, prefix).tolist()
    prompts = []
    for i in range(n):
        head = common if i % 2 == 1 else rng.integers(lo, hi, prefix).tolist()
        prompts.append(head + rng.integers(lo, hi, suffix).tolist())
    return prompts


def id_range(vocab: int) -> tuple[int, int]:
    """Token ids to draw from: [100, 100000) (ordinary tokens of the DeepSeek vocabulary), else [1, vocab)."""
    return (100, 100_000) if vocab > 100_000 else (1, vocab)


def warmup_prompt(vocab: int, seed: int) -> list[int]:
    """A short prompt of its own (no prefix in common with the workload)."""
    lo, hi = id_range(vocab)
    return np.random.default_rng(seed + 1).integers(lo, hi, WARMUP_TOKENS).tolist()


# --- results ---


@dataclass(slots=True)
class RequestResult:
    """What one HTTP request gave."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    ids_streamed: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class RunResult:
    """One run (HTTP or LLM direct)."""

    name: str
    wall_s: float
    output_tokens: int
    errors: int
    prompt_tokens: int
    device_tokens: int
    persistent_tokens: int
    swa_pool_requests: int
    replayed_tokens: int
    requests: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def share(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# --- engine and server ---


def engine_args(args: argparse.Namespace, persistent_dir: Path | None) -> Any:
    from kvdiet.cache.policies import parse_policy
    from kvdiet.engine.args import EngineArgs
    from kvdiet.engine.runner import CacheOptions
    from kvdiet.engine.scheduler import SchedulerConfig
    from kvdiet.units import parse_bytes

    cache = CacheOptions(
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        block_size=args.block_size,
        persistent_dir=persistent_dir,
        policy=parse_policy(args.swa_policy),
    )
    return EngineArgs(
        model=args.model,
        seed=SEED,
        cache=cache,
        max_model_len=args.max_model_len or args.prefix_tokens + args.suffix_tokens + args.max_tokens,
        scheduler=SchedulerConfig(args.max_num_seqs or args.clients, args.max_num_batched_tokens),
    )


def free_socket() -> socket.socket:
    """A TCP socket bound to 127.0.0.1 on a free port (uvicorn listens on it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Server:
    """The app under uvicorn on its own thread (the app's lifespan starts and closes the engine loop)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


def wait_idle(engine: Any, deadline: float, settle_s: float = 0.5) -> bool:
    """Wait until the engine has no request (waiting, running or unfinished) for ``settle_s`` seconds."""
    idle_since = None
    while time.monotonic() < deadline + 30:
        if engine.num_running == 0 and engine.num_waiting == 0 and not engine.requests:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= settle_s:
                return True
        else:
            idle_since = None
        time.sleep(0.05)
    return False


# --- HTTP clients ---


async def one_request(
    client: Any, model: str, prompt: list[int], max_tokens: int, res: RequestResult
) -> None:
    """Stream one completion; record its timings, tokens and usage in ``res`` (kept when cancelled)."""
    start = time.perf_counter()
    last = start
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens
                res.completion_tokens = chunk.usage.completion_tokens
                d = chunk.usage.prompt_tokens_details
                res.details = d.model_dump() if d is not None else {}
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            res.finish_reason = choice.finish_reason or res.finish_reason
            k = chunk_tokens(choice, res)
            if k == 0:
                continue
            if res.ttft_s is None:
                res.ttft_s = now - start
                res.itl_s += [0.0] * (k - 1)  # tokens arriving with the first one
            else:
                res.itl_s += [(now - last) / k] * k
            res.num_tokens += k
            last = now
    except asyncio.CancelledError:
        res.error = "cancelled at --timeout"
        raise
    except Exception as exc:  # any failure is an error of this request
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.error = res.error or check_result(res, max_tokens)


def chunk_tokens(choice: Any, res: RequestResult) -> int:
    """Output tokens a streamed choice carries: its ``token_ids`` (``return_token_ids``) when the server
    sends them, else 1 per chunk (the engine emits one output per generated token; an abort carries
    none)."""
    ids = (choice.model_extra or {}).get("token_ids")
    if ids is not None:
        res.ids_streamed = True
        res.token_ids += ids
        return len(ids)
    return 0 if choice.finish_reason == "abort" else 1


def check_result(res: RequestResult, max_tokens: int) -> str | None:
    if res.finish_reason != "length":
        return f"finish_reason {res.finish_reason!r}"
    if res.num_tokens != max_tokens:
        return f"{res.num_tokens} tokens streamed, {max_tokens} expected"
    if res.completion_tokens != max_tokens:
        return f"usage.completion_tokens {res.completion_tokens}, {max_tokens} expected"
    return None


async def run_clients(
    port: int, model: str, prompts: list[list[int]], max_tokens: int, clients: int, deadline: float
) -> tuple[list[RequestResult], float]:
    """All requests through ``clients`` concurrent streams; (results in prompt order, wall seconds)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="x",
        max_retries=0,
        timeout=max(1.0, deadline - time.monotonic()),
    )
    gate = asyncio.Semaphore(clients)
    results = [RequestResult() for _ in prompts]

    async def bounded(i: int) -> None:
        async with gate:
            await one_request(client, model, prompts[i], max_tokens, results[i])

    start = time.perf_counter()
    tasks = [asyncio.create_task(bounded(i)) for i in range(len(prompts))]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    for i, t in enumerate(tasks):
        if t in pending:
            results[i].error = results[i].error or "cancelled at --timeout"
    await client.close()
    return results, wall


def http_summary(name: str, results: list[RequestResult], wall: float) -> RunResult:
    det = [r.details for r in results]
    return RunResult(
        name=name,
        wall_s=wall,
        output_tokens=sum(r.num_tokens for r in results),
        errors=sum(r.error is not None for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        device_tokens=sum(d.get("device_tokens") or 0 for d in det),
        persistent_tokens=sum(d.get("persistent_tokens") or 0 for d in det),
        swa_pool_requests=sum(d.get("window_source") == "swa-pool" for d in det),
        replayed_tokens=sum(d.get("replayed_tokens") or 0 for d in det),
        requests=len(results),
        ttft=[r.ttft_s for r in results if r.ttft_s is not None],
        itl=[x for r in results for x in r.itl_s],
    )


def run_http(
    args: argparse.Namespace, persistent_dir: Path | None, deadline: float, console: Console
) -> tuple[RunResult, list[RequestResult], dict[str, Any]]:
    """The HTTP run: server up, warm-up, workload, leak check, server down."""
    from kvdiet.engine.loop import EngineLoop
    from kvdiet.server.app import build_app
    from kvdiet.server.metrics import ServerMetrics

    holder: dict[str, Any] = {}
    metrics = ServerMetrics(lambda: holder["loop"].snapshot, args.model)
    engine = engine_args(args, persistent_dir).create_engine(observer=metrics)
    loop = holder["loop"] = EngineLoop(engine)
    server = Server(build_app(loop, model_name=args.model, metrics=metrics))
    try:
        server.start()
    except BaseException:
        engine.runner.close()
        raise
    try:
        vocab = engine.model.cfg.vocab_size
        prompts = make_prompts(args.requests, args.prefix_tokens, args.suffix_tokens, vocab, args.seed)
        console.print(f"HTTP: warm-up, then {len(prompts)} requests on 127.0.0.1:{server.port} …")
        warm, _ = asyncio.run(
            run_clients(server.port, args.model, [warmup_prompt(vocab, args.seed)], 2, 1, deadline)
        )
        if warm[0].error:
            console.print(f"[red]warm-up failed: {warm[0].error}")
        blocks = engine.runner.pool.blocks
        wait_idle(engine, deadline)
        free_before = blocks.num_free
        results, wall = asyncio.run(
            run_clients(server.port, args.model, prompts, args.max_tokens, args.clients, deadline)
        )
        idle = wait_idle(engine, deadline)
        leak = {
            "free_before": free_before,
            "free_after": blocks.num_free,
            "idle": idle,
            "integrity_ok": integrity(blocks),
        }
    finally:
        server.stop()
    return http_summary(f"HTTP ({args.clients} clients)", results, wall), results, leak


def integrity(blocks: Any) -> bool:
    try:
        blocks.check_integrity()
    except AssertionError:
        return False
    return True


# --- LLM direct ---


class _Deadline:
    """Engine observer that stops `LLM.generate` at the deadline (it then aborts every request)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def on_first_token(self, request: Any, ttft_s: float) -> None:
        self._check()

    def on_token(self, request: Any, itl_s: float) -> None:
        self._check()

    def on_finish(self, request: Any) -> None:
        pass

    def _check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError("--timeout reached")


def run_llm(
    args: argparse.Namespace, persistent_dir: Path | None, deadline: float, console: Console
) -> tuple[RunResult, list[list[int]] | None]:
    """The same workload through `kvdiet.LLM` (warm-up first); (summary, output ids per request)."""
    from kvdiet import LLM, SamplingParams

    with LLM(args=engine_args(args, persistent_dir)) as llm:
        vocab = llm.engine.model.cfg.vocab_size
        prompts = make_prompts(args.requests, args.prefix_tokens, args.suffix_tokens, vocab, args.seed)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate([warmup_prompt(vocab, args.seed)], SamplingParams(max_tokens=2, ignore_eos=True))
        llm.engine.observer = _Deadline(deadline)
        console.print(f"LLM direct: {len(prompts)} requests …")
        start = time.perf_counter()
        try:
            outs = llm.generate(prompts, params)
        except TimeoutError:
            wall = time.perf_counter() - start
            console.print("[red]LLM direct: --timeout reached, requests aborted")
            return RunResult("LLM direct", wall, 0, len(prompts), 0, 0, 0, 0, 0, len(prompts)), None
        wall = time.perf_counter() - start
    provs = [o.provenance for o in outs]
    run = RunResult(
        name="LLM direct",
        wall_s=wall,
        output_tokens=sum(len(o.output_ids) for o in outs),
        errors=sum(o.finish_reason != "length" or len(o.output_ids) != args.max_tokens for o in outs),
        prompt_tokens=sum(o.prompt_tokens for o in outs),
        device_tokens=sum(p.device_tokens for p in provs if p is not None),
        persistent_tokens=sum(p.persistent_tokens for p in provs if p is not None),
        swa_pool_requests=sum(p is not None and p.window_source == "swa-pool" for p in provs),
        replayed_tokens=sum(p.replayed_tokens for p in provs if p is not None),
        requests=len(outs),
    )
    return run, [list(o.output_ids) for o in outs]


# --- report ---


def r6(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def table(http: RunResult, llm: RunResult | None, leak: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    cols = ("run", "requests", "errors", "wall s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    for col in (*cols, "device hit", "persistent hit", "SWA-pool reqs", "replayed"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in (http, llm):
        if r is None:
            continue
        t.add_row(
            r.name,
            str(r.requests),
            str(r.errors),
            f"{r.wall_s:.2f}",
            f"{r.tok_per_s:.2f}",
            *(fmt(pct(v, q)) for v, q in ((r.ttft, 50), (r.ttft, 99), (r.itl, 50), (r.itl, 99))),
            f"{r.share(r.device_tokens):.1%}",
            f"{r.share(r.persistent_tokens):.1%}",
            f"{r.swa_pool_requests / r.requests:.1%}" if r.requests else "—",
            f"{r.replayed_tokens:,}",
        )
    if llm is not None and llm.wall_s > 0 and llm.tok_per_s > 0:
        ratio_tok = http.tok_per_s / llm.tok_per_s
        t.add_row("HTTP / LLM", "", "", f"{http.wall_s / llm.wall_s:.3f}", f"{ratio_tok:.3f}", *[""] * 8)
    t.caption = (
        f"latencies in seconds (HTTP, client side); leak check: {leak['free_before']:,} free blocks before, "
        f"{leak['free_after']:,} after{'' if leak['idle'] else ' (engine NOT idle)'}, integrity "
        f"{'ok' if leak['integrity_ok'] else 'FAILED'}"
    )
    return t


def result_json(
    args: argparse.Namespace,
    http: RunResult,
    llm: RunResult | None,
    leak: dict[str, Any],
    same: int | None,
    ids_streamed: bool,
) -> dict[str, Any]:
    return {
        "bench": "serve",
        "model": args.model,
        "clients": args.clients,
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs or args.clients,
        "prompt_tokens_each": args.prefix_tokens + args.suffix_tokens,
        "max_tokens": args.max_tokens,
        "wall_s": r6(http.wall_s),
        "output_tokens": http.output_tokens,
        "output_tok_per_s": r6(http.tok_per_s),
        "ttft_p50_s": r6(pct(http.ttft, 50)),
        "ttft_p99_s": r6(pct(http.ttft, 99)),
        "itl_p50_s": r6(pct(http.itl, 50)),
        "itl_p99_s": r6(pct(http.itl, 99)),
        "errors": http.errors,
        "leaked_blocks": leak["free_before"] - leak["free_after"],
        "integrity_ok": leak["integrity_ok"],
        "hit_share": {
            "device": r6(http.share(http.device_tokens)),
            "persistent": r6(http.share(http.persistent_tokens)),
            "swa_pool_requests": r6(http.swa_pool_requests / http.requests if http.requests else 0.0),
        },
        "replayed_tokens": http.replayed_tokens,
        "token_ids_streamed": ids_streamed,
        "llm_wall_s": r6(llm.wall_s) if llm else None,
        "llm_output_tok_per_s": r6(llm.tok_per_s) if llm else None,
        "llm_errors": llm.errors if llm else None,
        "http_over_llm_wall": r6(http.wall_s / llm.wall_s) if llm and llm.wall_s else None,
        "http_over_llm_tok_per_s": r6(http.tok_per_s / llm.tok_per_s) if llm and llm.tok_per_s else None,
        "same_outputs_as_llm": same,
    }


def same_outputs(results: list[RequestResult], llm_ids: list[list[int]] | None) -> int | None:
    """Requests whose streamed token ids equal the LLM run's (None when ids were not streamed)."""
    if llm_ids is None or not all(r.ids_streamed for r in results):
        return None
    return sum(r.token_ids == ids for r, ids in zip(results, llm_ids, strict=True))


# --- main ---


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v4.1-mini", help="preset or V4.1 config path (default v4.1-mini)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default 4)")
    p.add_argument("--requests", type=int, default=16, help="requests in all (default 16)")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix length (default 512)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="unique suffix length (default 32)")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the prompts (default 0)")
    p.add_argument("--timeout", type=float, default=900.0, help="bound on the whole run, s (default 900)")
    p.add_argument(
        "--persistent-dir",
        help="persistent tier: runs use DIR/http and DIR/llm ('none': off; default: a fresh temporary dir)",
    )
    p.add_argument("--kv-cache-memory", default="256MiB", help="device-pool budget (default 256MiB)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--swa-policy", default="bounded-replay", help="SWA policy (default bounded-replay)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="engine max_model_len (default: prompt + max_tokens of the workload)",
    )
    p.add_argument("--max-num-seqs", type=int, help="engine max_num_seqs, both runs (default: --clients)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tokens per engine step (default 512)"
    )
    args = p.parse_args()
    for name in ("clients", "requests", "max_tokens", "prefix_tokens", "suffix_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run_dirs(arg: str | None, root: str) -> tuple[Path | None, Path | None]:
    if arg == "none":
        return None, None
    base = Path(arg) if arg else Path(root)
    (base / "http").mkdir(parents=True, exist_ok=True)
    (base / "llm").mkdir(parents=True, exist_ok=True)
    return base / "http", base / "llm"


def main() -> int:
    args = parse_args()
    deadline = time.monotonic() + args.timeout
    torch.manual_seed(SEED)
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvdiet-bench-serve-") as tmp:
        http_dir, llm_dir = run_dirs(args.persistent_dir, tmp)
        http, results, leak = run_http(args, http_dir, deadline, console)
        for i, r in enumerate(results):
            if r.error:
                console.print(f"[red]request {i}: {r.error}")
        llm, llm_ids = None, None
        if time.monotonic() < deadline:
            llm, llm_ids = run_llm(args, llm_dir, deadline, console)
        else:
            console.print("[red]LLM direct skipped: --timeout reached")
    ids_streamed = bool(results) and all(r.ids_streamed for r in results)
    if not ids_streamed:
        console.print("[yellow]the server streamed no token_ids: counted one token per chunk")
    title = (
        f"{args.model}: {args.requests} requests × ({args.prefix_tokens}+{args.suffix_tokens} prompt, "
        f"{args.max_tokens} out), half sharing the prefix; max_num_seqs {args.max_num_seqs or args.clients}"
    )
    Console(width=180).print(table(http, llm, leak, title))
    out = result_json(args, http, llm, leak, same_outputs(results, llm_ids), ids_streamed)
    print(json.dumps(out))
    errors = out["errors"] + (out["llm_errors"] or 0)
    failed = errors > 0 or out["leaked_blocks"] != 0 or not out["integrity_ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
