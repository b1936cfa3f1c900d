"""``kvdiet serve`` as a user runs it: a real process on a free loopback port, its start-up report, a
completion through the openai client, a clean stop on SIGINT; bad flags exit 2 with one line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from kvdiet.server.serve import default_persistent_dir

pytestmark = pytest.mark.slow

KVDIET = [sys.executable, "-m", "kvdiet.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_maximum_concurrency_counts_whole_blocks_per_request() -> None:
    """One request of --max-model-len 63 takes ceil(63 / 4) = 16 blocks: a pool of 16 holds 1.00 of them (vLLM's
    figure, blocks over blocks per request), not 64 / 63 = 1.02."""
    from kvdiet.config import load_config
    from kvdiet.engine.engine import LLMEngine
    from kvdiet.engine.runner import CacheOptions, ModelRunner
    from kvdiet.model.transformer import Transformer
    from kvdiet.server.serve import startup_report

    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    block_bytes = model.new_pool(1, block_size=4).block_bytes
    for blocks, max_model_len, figure in ((16, 63, "1.00x"), (16, 64, "1.00x"), (40, 63, "2.50x")):
        runner = ModelRunner(model, CacheOptions(kv_cache_memory=blocks * block_bytes, block_size=4))
        with runner:
            lines = startup_report(LLMEngine(model, runner, max_model_len=max_model_len))
        assert f"maximum concurrency for {max_model_len} tokens per request: {figure}" in lines


def test_the_api_key_line_says_whether_a_key_is_needed_and_never_shows_it() -> None:
    """An empty key (``KVDIET_API_KEY=``) is none, as `build_app` reads it; a key is never logged."""
    from kvdiet.server.serve import api_key_line

    for key in (None, ""):
        assert api_key_line(key).startswith("API key: none, /v1/* answers without Authorization")
    line = api_key_line("s3cret-Key")
    assert line.startswith("API key: required on /v1/* (Authorization: Bearer <key>") and "s3cret" not in line


def test_the_serving_line_names_the_port_the_system_chose() -> None:
    """``--port 0``: the URL logged is the one listened on, not port 0; an IPv6 host in brackets."""
    from kvdiet.server.serve import _bind, listen_url

    sock = _bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port != 0 and listen_url(sock) == f"http://127.0.0.1:{port}"
    finally:
        sock.close()
    if socket.has_ipv6:
        try:
            sock = _bind("::1", 0)
        except OSError:
            return  # no IPv6 loopback on this machine
        try:
            assert listen_url(sock) == f"http://[::1]:{sock.getsockname()[1]}"
        finally:
            sock.close()


def _start_micro_server(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """``kvdiet serve`` of v4.1-micro on a free loopback port (4-token blocks, 1 MiB of KV, a persistent tier
    under ``tmp_path``, ``KVDIET_API_KEY`` set empty: no key), its log in ``tmp_path``: (the process, the port,
    the log)."""
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [*KVDIET, "serve", "--model", "v4.1-micro", "--port", str(port), "--block-size", "4"]
    cmd += ["--kv-cache-memory", "1MiB", "--persistent-dir", str(tmp_path / "kv")]
    with log.open("w") as out:
        env = {**os.environ, "KVDIET_API_KEY": ""}  # empty is no key: the clients' "Bearer x" is not refused
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, port, log


def _wait_started(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while "Application startup complete" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_serve_starts_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    proc, port, log = _start_micro_server(tmp_path)
    stopped = False
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        _wait_started(proc, log)
        text = log.read_text()
        assert "KV cache: 2,473 blocks × 4 tokens = 9,892 tokens" in text  # 1 MiB // 424 B per 4-token block
        assert "maximum concurrency for 256 tokens per request: 38.64x" in text
        assert f"serving 'v4.1-micro' on http://127.0.0.1:{port}/v1" in text
        assert "API key: none, /v1/* answers without Authorization" in text
        r = client.completions.create(model="v4.1-micro", prompt=list(range(1, 20)), max_tokens=3)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        assert any((tmp_path / "kv").rglob("*.kvb"))  # full blocks written through to the persistent tier
        # SIGINT while a long stream runs: the stream ends at once with "abort" and [DONE].
        stream = client.completions.create(
            model="v4.1-micro", prompt=[1, 2, 3], max_tokens=250, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        proc.send_signal(signal.SIGINT)
        stopped = True
        rest = list(stream)  # the client stops at [DONE]; a cut connection would raise here
        assert rest[-1].choices[0].finish_reason == "abort"
    finally:
        if not stopped:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    assert rc == 0, log.read_text()
    assert "Application shutdown complete" in log.read_text() and "Traceback" not in log.read_text()


def test_a_second_sigint_still_closes_the_engine_and_logs_no_traceback(tmp_path: Path) -> None:
    """Ctrl+C twice while a stream runs: uvicorn's forced exit skips the application's shutdown; kvdiet's server
    runs it in order ("Application shutdown complete"), exit status 0 and no CancelledError traceback (was logged
    by Starlette when asyncio's teardown cancelled the lifespan)."""
    proc, port, log = _start_micro_server(tmp_path)
    try:
        _wait_started(proc, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="v4.1-micro", prompt=[1, 2, 3], max_tokens=250, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert list(stream)[-1].choices[0].finish_reason == "abort"
    finally:
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a third Ctrl+C would exit at once (130): kill, then fail below
            proc.kill()
            rc = proc.wait()
    text = log.read_text()
    assert rc == 0, text
    assert "Application shutdown complete" in text and "Traceback" not in text, text


def test_a_third_sigint_exits_at_once(monkeypatch) -> None:
    """Ctrl+C three times: the first aborts every request and asks uvicorn to stop, the second forces its exit (the
    shutdown still waits for the step in progress), the third exits the process at once with status 130."""
    import uvicorn

    from kvdiet.server import serve

    aborted, exits = [], []

    def exit_now(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(serve.os, "_exit", exit_now)

    class Loop:
        def abort_all(self) -> None:
            aborted.append(True)

    server = serve._AbortingServer(uvicorn.Config(lambda *a: None), Loop())
    server.handle_exit(signal.SIGINT, None)
    assert (server.should_exit, server.force_exit, len(aborted), exits) == (True, False, 1, [])
    server.handle_exit(signal.SIGINT, None)
    assert (server.force_exit, len(aborted), exits) == (True, 2, [])
    with pytest.raises(SystemExit):
        server.handle_exit(signal.SIGINT, None)
    assert exits == [130] and len(aborted) == 2


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [*KVDIET, "serve", "--model", "v4.1-micro", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "loading" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-model-len", "1M"], "--max-model-len must be in [1, 256]"),
        (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens (4) must be >="),
        (["--kv-cache-memory", "100B"], "below one block"),
        (
            ["--kv-cache-memory", "20KiB", "--block-size", "4"],
            "needs 64 blocks of 4 tokens, but the KV cache holds 48",
        ),
        (["--swa-policy", "sometimes"], "sometimes"),
        (["--swa-pool", "redis://127.0.0.1:99999/0"], "--swa-pool: bad Redis URL"),
        (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
        (["--served-model-name", ""], "--served-model-name must not be empty, got ''"),
        (["--served-model-name", " \t"], "--served-model-name must not be empty, got ' \\t'"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    """Each flag is checked before the port is bound: with the port busy, the flag's own error is reported,
    never "cannot listen" (issue 14: three tests failed while a server held the default port)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [*KVDIET, "serve", "--model", "v4.1-micro", "--persistent-dir", "none", "--port", str(port)]
        proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert "cannot listen" not in proc.stderr and "loading" not in proc.stderr


def test_no_test_starts_serve_on_a_fixed_port() -> None:
    """Every test file that runs ``kvdiet serve`` picks a free loopback port and names no fixed one (the
    default port is often held by a server the README left running)."""
    default_port, starts = 8_000, 0
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        text = path.read_text()
        if '"serve",' not in text or path.name == "test_cli.py":  # test_cli: argparse errors, nothing bound
            continue
        starts += 1
        assert "free_port()" in text, f"{path.name} runs kvdiet serve without a free port"
        assert not re.search(rf"\b{default_port}\b", text), f"{path.name} names port {default_port}"
    assert starts >= 3


def test_default_persistent_dir_follows_xdg(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_persistent_dir() == tmp_path / "kvdiet" / "persistent"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_persistent_dir() == Path(os.path.expanduser("~")) / ".cache" / "kvdiet" / "persistent"


def test_a_bad_block_size_fails_before_the_model_loads() -> None:
    """Issue 18 point 6: ``--block-size 3`` was refused only after the model had loaded."""
    cmd = [*KVDIET, "serve", "--model", "v4.1-micro", "--persistent-dir", "none", "--block-size", "3"]
    proc = subprocess.run([*cmd, "--port", str(_free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--block-size: block size 3 must be a positive multiple of every compress ratio" in proc.stderr
    assert "loading" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--weights", "ckpt/DeepSeek-V4.1-Flash"], "ckpt/DeepSeek-V4.1-Flash"),  # the path as given, as vLLM
        (["--weights", "ckpt/w", "--model", "v4.1-micro"], "v4.1-micro"),
        (["--weights", "ckpt/w", "--served-model-name", "flash"], "flash"),
        ([], None),  # the default model's own name, once it is chosen
    ],
)
def test_a_checkpoint_is_served_under_its_path_as_given(flags: list[str], name: str | None) -> None:
    """``serve --weights DIR`` names the model ``DIR`` (vLLM serves a path under the path given), not the
    ``DIR/config.json`` its config is read from."""
    from kvdiet.cli import _build_parser
    from kvdiet.server.serve import served_model_name

    assert served_model_name(_build_parser().parse_args(["serve", *flags])) == name
