"""``kvdiet serve``: flags, start-up report and the uvicorn run of the OpenAI-compatible server.

Defaults: model ``v4.1-mini`` (seeded random weights, the real DeepSeek tokenizer), the persistent tier in
the user's cache directory (``$XDG_CACHE_HOME/kvdiet/persistent``, else ``~/.cache/kvdiet/persistent``),
the in-process SWA pool (``--swa-pool redis://HOST:PORT/DB`` or ``mooncake://HOST:PORT`` shares it), bounded replay,
``127.0.0.1:8000``. The start-up log states the KV-cache budget
in blocks, tokens and bytes and the maximum concurrency at ``--max-model-len``, as vLLM's does.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from kvdiet.engine.args import EngineArgs
from kvdiet.units import format_bytes

if TYPE_CHECKING:
    from kvdiet.engine.loop import EngineLoop

__all__ = [
    "add_serve_parser",
    "api_key_line",
    "default_persistent_dir",
    "listen_url",
    "run_serve",
    "served_model_name",
]

log = logging.getLogger("kvdiet.serve")

EPILOG = """\
examples:
  kvdiet serve                                   # v4.1-mini on http://127.0.0.1:8000/v1
  kvdiet serve --max-model-len 32K --max-num-seqs 8 --api-key secret
  kvdiet serve --model v4.1-micro --persistent-dir none --port 8001   # token ids in and out (no tokenizer)
  kvdiet serve --swa-pool redis://127.0.0.1:6379/0      # window snapshots shared through Redis
  kvdiet serve --swa-pool mooncake://127.0.0.1:50051 --swa-pool-size 0   # ... through Mooncake Store
then:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "v4.1-mini", "prompt": "The KV cache", "max_tokens": 8}'
"""


def default_persistent_dir() -> Path:
    """``$XDG_CACHE_HOME/kvdiet/persistent`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdiet" / "persistent"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics) over the engine",
        description="Load a V4.1 model and serve it over an OpenAI-compatible API with continuous "
        "batching, chunked prefill, preemption, the prefix cache, the persistent tier, the SWA pool and "
        "bounded replay. Weights are seeded random unless --weights is given: the text is meaningless, the "
        "cache system and its numbers are real.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="preset or V4.1 / V4-Flash config path (default: the config.json beside --weights, else v4.1-mini)",
    )
    p.add_argument(
        "--served-model-name",
        help="name clients use in 'model' (default: --model as given, else the --weights path as given, as vLLM "
        "names a model by the path it serves)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVDIET_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default $KVDIET_API_KEY, else none; empty: none)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per engine step, prefill chunks and decodes together (default 512)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="chat max_tokens when a request gives none (default 256, capped by the context left)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log lines shown, kvdiet's and uvicorn's (default info: start-up report, requests)",
    )
    EngineArgs.add_cli_args(p, persistent_default=str(default_persistent_dir()))


def run_serve(args: argparse.Namespace) -> None:
    """Build the engine from the flags, log the cache budget, serve until interrupted.

    Raises:
        ValueError, ConfigError, OSError: bad flags or model (before anything is served).
    """
    from kvdiet.engine.loop import EngineLoop
    from kvdiet.engine.scheduler import SchedulerConfig
    from kvdiet.server.app import build_app
    from kvdiet.server.metrics import ServerMetrics

    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    name = served_model_name(args)  # before --model is filled in from --weights' config.json
    engine_args = EngineArgs.from_cli_args(
        args, scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
    )
    engine_args.validate()  # every flag is checked before the port is bound
    name = name or args.model  # no model named: the default one
    sock = _bind(args.host, args.port)  # a busy port or a bad host fails now, before the model loads
    log.info(
        "loading %s (seed %d%s)", args.model, args.seed, f", weights {args.weights}" if args.weights else ""
    )
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["loop"].snapshot, name)
    engine = engine_args.create_engine(observer=metrics)
    engine.runner.threads = args.thread_pool  # a default-sized CPU pool adapts (`kvdiet.threads`)
    loop = holder["loop"] = EngineLoop(engine)
    for line in startup_report(engine):
        log.info(line)
    app = build_app(
        loop,
        model_name=name,
        metrics=metrics,
        api_key=args.api_key,
        default_max_tokens=args.default_max_tokens,
    )
    log.info("serving %r on %s/v1 (metrics at /metrics)", name, listen_url(sock))
    log.info(api_key_line(args.api_key))
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=10)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal after a clean shutdown
        _AbortingServer(config, loop).run(sockets=[sock])


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv4, or IPv6 when ``host`` has a colon); uvicorn listens on it.

    Raises:
        OSError: the address is in use or not valid here (one line).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def listen_url(sock: socket.socket) -> str:
    """``http://host:port`` of the address ``sock`` is bound to: the port the system chose for ``--port 0``, an
    IPv6 host in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


class _AbortingServer(uvicorn.Server):
    """uvicorn's server, except that a shutdown signal first aborts every request: open streams end at once
    with ``finish_reason: "abort"`` and ``[DONE]`` instead of being cut at the graceful-shutdown timeout. A
    second Ctrl+C skips uvicorn's waits but not the application's shutdown (`shutdown`); a third exits at once
    (status 130), with a warning, without waiting for the step in progress."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = loop

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.force_exit and sig == signal.SIGINT:  # a third Ctrl+C: not waiting for the step in progress
            log.warning(
                "a third Ctrl+C: exiting now, the step in progress cut and the cache tiers not closed"
            )
            os._exit(130)
        self.engine_loop.abort_all()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, then the application's own (the lifespan's end: `EngineLoop.close`) where a second
        Ctrl+C made uvicorn skip it. Skipped, the engine closed only as asyncio's teardown cancelled the lifespan
        (the close ran in its ``finally``), and Starlette logged that cancellation as a traceback. It waits as long
        as the graceful path does: for the step in progress to end, since the first signal aborted every request
        at the next step boundary."""
        await super().shutdown(sockets)
        done = getattr(self.lifespan, "shutdown_event", None)  # uvicorn's LifespanOn; "off" has none
        if self.force_exit and done is not None and not done.is_set():
            await self.lifespan.shutdown()


def served_model_name(args: argparse.Namespace) -> str | None:
    """The name clients use in ``model``: ``--served-model-name``, else ``--model`` as given, else the
    ``--weights`` path as given (vLLM's default: the model argument, a checkpoint's folder); None when none of
    them is given (the default model's name is then the name). Read before ``--model`` is filled in from the
    folder's ``config.json`` (`kvdiet.engine.weights_args.resolve_model`).

    Raises:
        ValueError: ``--served-model-name`` given empty or all whitespace (no client could name it).
    """
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError(f"--served-model-name must not be empty, got {args.served_model_name!r}")
    return args.served_model_name or args.model or (str(args.weights) if args.weights else None)


def api_key_line(api_key: str | None) -> str:
    """The start-up line that says whether ``/v1/*`` needs an API key (never the key itself); an empty key is
    none, as `kvdiet.server.app.build_app` reads it."""
    if api_key:
        return "API key: required on /v1/* (Authorization: Bearer <key>; /health and /metrics are open)"
    return (
        "API key: none, /v1/* answers without Authorization (set --api-key or $KVDIET_API_KEY to require one)"
    )


def startup_report(engine: object) -> list[str]:
    """The start-up lines: KV-cache budget (blocks, tokens, bytes), maximum concurrency at max_model_len,
    the tiers and the policy."""
    cache = engine.runner
    pool, bs, opts = cache.pool, cache.options.block_size, cache.options
    blocks = pool.blocks.num_blocks
    tokens = blocks * bs
    lines = [
        weights_line(engine.model),
        f"KV cache: {blocks:,} blocks × {bs} tokens = {tokens:,} tokens, {format_bytes(blocks * pool.block_bytes)} "
        f"({pool.block_bytes:,} B per block, {pool.block_bytes / bs:,.1f} B/token of global KV)",
        # vLLM's figure: blocks over the ceil(max_model_len / block_size) blocks one request of it takes
        f"maximum concurrency for {engine.max_model_len:,} tokens per request: "
        f"{blocks / -(-engine.max_model_len // bs):.2f}x",
    ]
    p = cache.persistent
    if p is not None and p.enabled:
        lines.append(
            f"persistent tier: {opts.persistent_dir} (TTL {opts.persistent_ttl_s / 3600:g} h, {len(p):,} entries, "
            f"{format_bytes(p.nbytes)} resident{', read-only' if p.read_only else ''})"
        )
    else:
        lines.append("persistent tier: off")
    lines.append(
        f"global pool: {cache.global_pool!r}" if cache.global_pool is not None else "global pool: off"
    )
    lines.append(
        f"{cache.swa_pool!r}; "
        f"SWA policy {opts.policy}; decoder-side replay {'on' if cache.decoder_replay else 'off'}; "
        f"prefix caching {'on' if opts.prefix_caching else 'off'}"
    )
    sched = engine.scheduler.config
    lines.append(
        f"scheduler: --max-num-seqs {sched.max_num_seqs}, --max-num-batched-tokens {sched.max_num_batched_tokens}, "
        f"--max-model-len {engine.max_model_len:,}"
    )
    return lines


def weights_line(model: object) -> str:
    """Where the weights came from and which numerics run (the start-up log, ``generate --json``)."""
    report = getattr(model, "load_report", None)
    if report is None:
        return "weights: seeded random (bf16 numerics: plain fp32 matmuls)"
    linears = ", ".join(f"{n} {kind}" for kind, n in report.linears.items() if n)
    what = (
        "FP8 activations before every FP8/FP4 linear, as DeepSeek's reference"
        if report.numerics == "fp8"
        else "weights dequantised, plain fp32 matmuls"
    )
    line = (
        f"weights: {format_bytes(report.checkpoint_bytes)} checkpoint; {report.numerics} numerics ({what}); "
        f"linears {linears}"
    )
    if report.expert_cache is not None:
        line += f"; routed experts read on first use, cache {format_bytes(report.expert_cache.budget_bytes)}"
    return line
