"""The OpenAI-compatible server for real: uvicorn on a free loopback port, the official ``openai`` client
(streaming and not), raw HTTP for the error cases and disconnects, Prometheus metrics.

The main server runs v4.1-mini (the real DeepSeek tokenizer and cache geometry) with a persistent tier in a
temporary directory; a v4.1-micro server checks the API key and a failed engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvdiet.engine.args import EngineArgs
from kvdiet.engine.chat_template import render_chat
from kvdiet.engine.generate import generate
from kvdiet.engine.loop import EngineLoop
from kvdiet.engine.runner import CacheOptions
from kvdiet.engine.sampling import SamplingParams
from kvdiet.engine.scheduler import SchedulerConfig
from kvdiet.server.app import build_app
from kvdiet.server.metrics import ServerMetrics

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 4096


@contextlib.contextmanager
def running_server(args: EngineArgs, name: str, **app_kw) -> Iterator[tuple[str, EngineLoop]]:
    """Serve ``args`` on a free 127.0.0.1 port in a thread; yields (base URL, engine loop); stops it."""
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["loop"].snapshot, name)
    loop = holder["loop"] = EngineLoop(args.create_engine(observer=metrics))
    app = build_app(loop, model_name=name, metrics=metrics, **app_kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def _post(base: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    conn.request("POST", path, data, {k: v for k, v in sent.items() if v is not None})  # None: not sent
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def _get(base: str, path: str, method: str = "GET", timeout: float = 30) -> tuple[int, str]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request(method, path)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def _wait_idle(loop: EngineLoop, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while (loop.engine.requests or loop.engine.has_unfinished) and time.monotonic() < end:
        time.sleep(0.05)
    assert not loop.engine.requests, "requests still in the engine"


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Iterator[tuple[str, EngineLoop]]:
    args = EngineArgs(
        model="v4.1-mini",
        cache=CacheOptions(kv_cache_memory=64 << 20, persistent_dir=tmp_path_factory.mktemp("persistent")),
        max_model_len=MAX_MODEL_LEN,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )
    with running_server(args, "v4.1-mini") as served:
        yield served


@pytest.fixture(scope="module")
def client(mini) -> openai.OpenAI:
    return openai.OpenAI(base_url=mini[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _solo(loop: EngineLoop, ids: list[int], n: int) -> list[int]:
    return generate(loop.engine.model, ids, SamplingParams(max_tokens=n)).output_ids


def test_completion_and_stream_with_the_openai_client(mini, client) -> None:
    _, loop = mini
    tok = loop.engine.tokenizer
    prompt = "The KV cache of DeepSeek-V4.1"
    ids = [tok.bos_token_id, *tok.encode(prompt)]
    r = client.completions.create(
        model="v4.1-mini", prompt=prompt, max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    assert choice.model_extra["token_ids"] == _solo(loop, ids, 3)
    assert choice.text == tok.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert r.model_extra["prompt_token_ids"] == ids

    chunks = list(
        client.completions.create(
            model="v4.1-mini",
            prompt=prompt,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # 7 tokens: no full block to share


def test_a_stop_string_is_cut_or_kept_as_include_stop_str_in_output_says(mini, client) -> None:
    """vLLM's ``include_stop_str_in_output`` over HTTP: without it the text ends before the first stop string,
    with it just after; a stream adds up to the same text; ``stop_reason`` names the stop string (vLLM's), and
    is null where the output ended on length."""
    ask = {"model": "v4.1-mini", "prompt": "Bounded replay rebuilds", "max_tokens": 8, "temperature": 0}
    full = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i : i + 2] for i in range(len(full) // 3, len(full) - 1) if full[i : i + 2].strip())
    begin = full.find(stop)
    for include, want in ((False, full[:begin]), (True, full[: begin + len(stop)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        r = client.completions.create(**ask, stop=[stop], extra_body=extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), (full, stop, include)
        assert r.choices[0].model_extra["stop_reason"] == stop
        chunks = list(client.completions.create(**ask, stop=[stop], stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        reasons = [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices]
        assert reasons[-1] == stop and not any(reasons[:-1])
    plain = client.completions.create(**ask, stop=["no such text"], extra_body={"ignore_eos": True})
    assert (plain.choices[0].finish_reason, plain.choices[0].model_extra["stop_reason"]) == ("length", None)


def test_chat_completion_and_stream(mini, client) -> None:
    _, loop = mini
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    ids = loop.engine.tokenizer.encode(render_chat(messages))
    r = client.chat.completions.create(model="v4.1-mini", messages=messages, max_tokens=3, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == loop.engine.tokenizer.decode(
        _solo(loop, ids, 3), skip_special_tokens=True
    )
    chunks = list(
        client.chat.completions.create(
            model="v4.1-mini", messages=messages, max_tokens=3, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[
        0
    ]  # the role alone first, as OpenAI and vLLM send it; no later chunk repeats it
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    assert all(c.choices[0].delta.role is None for c in chunks[1:]) and len(chunks) == 1 + 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_reply_from_the_sdks_stream_helper_can_be_sent_back(mini, client) -> None:
    """The OpenAI SDK's ``chat.completions.stream`` helper gives its final reply as a
    `ParsedChatCompletionMessage`, whose ``parsed`` key (null without a response_format) travels with it when
    the message object, or its ``model_dump()``, is sent back in the next request, as the SDK's docs do: taken,
    with the prompt of the same conversation sent as role and content only."""
    first = [{"role": "user", "content": "What is a KV cache?"}]
    # the helper refuses a reply cut by length: it ends on its first token, named a stop token
    greedy = client.chat.completions.create(
        model="v4.1-mini", messages=first, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    stop = {"stop_token_ids": greedy.choices[0].model_extra["token_ids"]}
    stopped = client.chat.completions.create(
        model="v4.1-mini", messages=first, max_tokens=4, temperature=0, extra_body=stop
    )
    assert stopped.choices[0].model_extra["stop_reason"] == stop["stop_token_ids"][0]  # the id, as vLLM's
    with client.chat.completions.stream(
        model="v4.1-mini", messages=first, max_tokens=4, temperature=0, extra_body=stop
    ) as s:
        reply = s.get_final_completion().choices[0].message
    assert "parsed" in reply.model_dump()
    then = {"role": "user", "content": "Shorter."}
    plain = [*first, {"role": "assistant", "content": reply.content}, then]
    want = client.chat.completions.create(model="v4.1-mini", messages=plain, max_tokens=2, temperature=0)
    for sent in (reply, reply.model_dump()):
        r = client.chat.completions.create(
            model="v4.1-mini", messages=[*first, sent, then], max_tokens=2, temperature=0
        )
        assert r.usage.prompt_tokens == want.usage.prompt_tokens
        assert r.choices[0].message.content == want.choices[0].message.content


def test_stream_ends_with_done_on_the_wire(mini) -> None:
    base, _ = mini
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": [0, 500, 600], "max_tokens": 2, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_concurrent_streams_are_batched_and_match_solo_runs(mini) -> None:
    base, loop = mini
    prompts = [[0, *range(1000 + 10 * i, 1000 + 10 * i + 5 + i)] for i in range(4)]
    aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(p: list[int]) -> list[int]:
        stream = await aclient.completions.create(
            model="v4.1-mini",
            prompt=p,
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return [t async for c in stream for t in c.choices[0].model_extra["token_ids"]]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(main())
    assert got == [_solo(loop, p, 3) for p in prompts]


def test_repeated_prompt_reports_cached_tokens_by_tier(mini, client) -> None:
    _, loop = mini
    prompt = "Bounded replay rebuilds the window state. " * 30  # ~240 tokens: 3 full blocks of 64
    n = len(loop.engine.tokenizer.encode(prompt)) + 1
    first, second = (
        client.completions.create(model="v4.1-mini", prompt=prompt, max_tokens=1) for _ in range(2)
    )
    hit = (n - 1) // 64 * 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    d = second.usage.prompt_tokens_details
    assert d.cached_tokens == hit > 0
    assert d.model_extra["device_tokens"] == hit and d.model_extra["persistent_tokens"] == 0
    assert d.model_extra["global_pool_tokens"] == 0  # no --global-pool
    assert d.model_extra["window_source"] == "swa-pool" and d.model_extra["replayed_tokens"] == 0


def test_a_wrong_method_is_405_with_its_allow_header(mini) -> None:
    """GET on a POST route: the OpenAI error shape, and the ``Allow`` header HTTP asks of a 405 (it was dropped)."""
    base, _ = mini
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/completions")
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert (resp.status, resp.getheader("allow")) == (405, "POST")
    assert body["error"]["code"] == 405 and body["error"]["message"] == "Method Not Allowed"


def test_a_body_over_the_cap_is_413_before_it_is_read(mini) -> None:
    """A ``Content-Length`` past `MAX_BODY_BYTES` is answered at once: the server does not wait for (or read) the
    body, which this client never sends."""
    from kvdiet.server.app import MAX_BODY_BYTES

    base, loop = mini
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()  # no body follows
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and body["error"]["code"] == 413
    assert body["error"]["message"] == (
        f"the body is {MAX_BODY_BYTES + 1:,} bytes, over the {MAX_BODY_BYTES:,} this server reads"
    )
    assert not loop.engine.requests


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tokenizing_a_prompt_does_not_hold_up_the_event_loop(mini, monkeypatch, path: str) -> None:
    """While one request's prompt is being tokenized (here held until released; a 15 MB prompt took some 10 s),
    ``/health`` answers: tokenizing runs in a worker thread. On the event loop, the health check waited."""
    import kvdiet.server.routes as routes

    base, loop = mini
    entered, release = threading.Event(), threading.Event()

    def held(original: Callable) -> Callable:
        def call(*args, **kwargs):
            entered.set()
            release.wait(timeout=30)
            return original(*args, **kwargs)

        return call

    if path == "/v1/completions":
        monkeypatch.setattr(loop.engine, "prepare", held(loop.engine.prepare))
        body: dict = {"prompt": "hello there", "max_tokens": 1}
    else:
        monkeypatch.setattr(routes, "chat_prompt_ids", held(routes.chat_prompt_ids))
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}
    answer: list = []
    sender = threading.Thread(target=lambda: answer.append(_post(base, path, body)), daemon=True)
    sender.start()
    try:
        assert entered.wait(timeout=30)
        assert _get(base, "/health", timeout=5) == (200, "")  # answered while the prompt is still held
    finally:
        release.set()
        sender.join(timeout=120)
    assert answer[0][0] == 200 and answer[0][1]["usage"]["completion_tokens"] == 1
    _wait_idle(loop)


def test_a_chunked_body_over_the_cap_is_413_and_one_under_it_is_served(mini) -> None:
    """Without ``Content-Length`` (``Transfer-Encoding: chunked``) the body is read up to `MAX_BODY_BYTES`, then
    refused (a 64 MB one was read whole, taking the server to 10 GB); a small chunked request is served as
    usual."""
    from kvdiet.server.app import MAX_BODY_BYTES

    base, loop = mini
    host, port = base.removeprefix("http://").split(":")

    def chunked(pieces) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        try:
            for piece in pieces:
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the server answered before the body's end
            pass
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        return resp.status, body

    # a JSON string of MAX_BODY_BYTES + 2 MiB, in 1 MiB chunks: the server stops reading past the cap
    pad = b"x" * (1 << 20)
    pieces = [b'{"prompt": "', *([pad] * (MAX_BODY_BYTES // len(pad) + 2)), b'", "max_tokens": 1}']
    status, body = chunked(pieces)
    assert status == 413 and body["error"]["message"] == (
        f"the body (sent in chunks) is over the {MAX_BODY_BYTES:,} bytes this server reads"
    )
    status, body = chunked([b'{"prompt": [5, 6, 7], ', b'"max_tokens": 2}'])
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    _wait_idle(loop)


def test_models_health_and_metrics(mini, client) -> None:
    base, loop = mini
    assert [m.id for m in client.models.list().data] == ["v4.1-mini"]
    # the SDK's models.retrieve (was 404 Not Found for the served name), and HEAD probes (were 405)
    card = client.models.retrieve("v4.1-mini")
    assert (card.id, card.owned_by) == ("v4.1-mini", "kvdiet")
    status, text = _get(base, "/v1/models/other")
    assert status == 404 and "the model 'other' does not exist; this server serves 'v4.1-mini'" in text
    assert _get(base, "/health", "HEAD") == (200, "") and _get(base, "/v1/models", "HEAD") == (200, "")
    assert _get(base, "/health")[0] == 200
    # every operation its own id (GET and HEAD of one function shared one: a schema client generators refuse)
    schema = json.loads(_get(base, "/openapi.json")[1])
    ids = [op["operationId"] for item in schema["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)) and {"/health", "/v1/models"} <= set(schema["paths"])
    assert "get" in schema["paths"]["/health"] and "head" not in schema["paths"]["/health"]
    client.completions.create(model="v4.1-mini", prompt="metrics " * 150, max_tokens=1)
    # two tokens: one inter-token interval of its own (the test holds also when run alone)
    client.completions.create(
        model="v4.1-mini", prompt="metrics " * 150, max_tokens=2, extra_body={"ignore_eos": True}
    )
    time.sleep(0.6)  # the snapshot refreshes every 0.25 s
    status, text = _get(base, "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    stats = loop.engine.runner.stats
    assert samples[("kvdiet:prefix_cache_hits_total", (("tier", "device"),))] == stats.device.hit_tokens > 0
    assert samples[("kvdiet:prefix_cache_queries_total", (("tier", "persistent"),))] >= 0
    assert samples[("kvdiet:time_to_first_token_seconds_count", ())] >= 2
    assert samples[("kvdiet:inter_token_latency_seconds_count", ())] >= 1
    assert samples[("kvdiet:persistent_bytes", ())] > 0 and samples[("kvdiet:persistent_entries", ())] > 0
    assert samples[("kvdiet:swa_pool_entries", ())] >= 1 and samples[("kvdiet:swa_pool_bytes", ())] > 0
    assert (
        samples[("kvdiet:num_requests_running", ())] == 0
        and samples[("kvdiet:num_requests_waiting", ())] == 0
    )
    assert samples[("kvdiet:kv_cache_usage_perc", ())] == 0.0
    assert samples[("kvdiet:request_success_total", (("finished_reason", "length"),))] >= 2
    for name in ("replayed_tokens_total", "cache_evictions_total", "cache_expirations_total"):
        assert any(key[0] == f"kvdiet:{name}" for key in samples), name


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, "empty prompt"),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}, "empty prompt"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 5000},
            "max_tokens (5,000) = 5,002 tokens > max_model_len 4,096",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 0},
            "max_tokens: Input should be greater than or equal to 1",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", b'{"prompt": "hi", ', "malformed JSON"),
        (
            "/v1/completions",
            {"prompt": [0, 129280]},
            "token id 129280 at index 1 is outside the vocabulary [0, 129280)",
        ),
        ("/v1/completions", {"prompt": [0, -1]}, "token id -1 at index 1"),
        ("/v1/completions", {"prompt": [1.5, 2]}, "token id 1.5 at index 0 is not an integer"),
        ("/v1/completions", {"prompt": [[2, 0.5]]}, "token id 0.5 at index 1 is not an integer"),
        ("/v1/completions", {"prompt": [1.0, 2]}, "token id 1.0 at index 0 is not an integer"),
        ("/v1/completions", {"prompt": [2, True]}, "token id true at index 1 is not an integer"),
        ("/v1/completions", {"prompt": [1, "1_0"]}, 'token id "1_0" at index 1 is not an integer'),
        ("/v1/completions", {"prompt": [["1", 2]]}, 'token id "1" at index 0 is not an integer'),
        ("/v1/completions", {"prompt": [1, None]}, "token id null at index 1 is not an integer"),
        ("/v1/completions", {"prompt": [1, [2]]}, "token id [2] at index 1 is not an integer"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["5"]}, "stop_token_ids.0: Input should be"),
        (
            "/v1/completions",
            {"prompt": "hi", "top_k": -2},
            "top_k: Input should be greater than or equal to -1",
        ),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [200000]}, "stop token id 200000"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias token id 999999"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n: Input should be less than or equal to 1"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs is not supported"),
        (
            "/v1/completions",
            {"prompt": "hi", "repetition_penalty": 1.2},
            "repetition_penalty is not supported",
        ),
        ("/v1/completions", {"prompt": "hi", "foo": 1}, "unknown field(s): foo"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed: Input should be less than"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 0}, "logprobs is not supported"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "only allowed with stream",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "false"}},
            "chat_template_kwargs takes only 'thinking'",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per request"),
        ("/v1/chat/completions", {"messages": []}, "at least one message"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, "last message"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "role 'tool'"),
        (
            "/v1/chat/completions",
            {"messages": [1]},
            "messages.0: must be a message: an object with role and content",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop: item 0 must be a string (got a number)"),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": ["x", None]},
            "stop: item 1 must be a string (got null)",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": ["x", "y" * 1025]},
            "stop: item 1 must be at most 1,024 characters (got a string of 1,025 characters)",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": ["x"] * 17},
            "stop: must be at most 16 stop strings (got an array of 17 items)",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": 5},
            "stop: must be a string of at most 1,024 characters or a list",
        ),
        (  # was "must be a string of at most 1,024 characters ... (got a string of 1 characters)"
            "/v1/completions",
            {"prompt": "hi", "stop": "\ud800"},
            "stop: the text is not valid Unicode: unpaired surrogate U+D800 at character 0",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": ["ok", "a\udc00b"]},
            "stop: item 1: the text is not valid Unicode: unpaired surrogate U+DC00 at character 1",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9999},
            "> max_model_len 4,096",
        ),
    ],
)
def test_bad_requests_get_400_and_the_engine_keeps_serving(mini, path, body, message) -> None:
    base, loop = mini
    status, err = _post(base, path, body)
    assert status == 400, err
    assert message in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == 400
    assert not loop.engine.requests
    status, ok = _post(base, "/v1/completions", {"prompt": [0, 42], "max_tokens": 1})
    assert status == 200 and ok["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_another_model_is_not_found(mini, path) -> None:
    """A model this server does not serve: 404 (OpenAI's and vLLM's answer), naming the one it serves."""
    base, loop = mini
    body = {"model": "gpt-4", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    status, err = _post(base, path, body)
    assert status == 404 and err["error"]["code"] == 404 and err["error"]["param"] == "model", err
    assert err["error"]["message"] == "the model 'gpt-4' does not exist; this server serves 'v4.1-mini'"
    assert not loop.engine.requests


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [0, 129280]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x", ""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [200000]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"+1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "min_p": 0.1}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [], "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9999},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [200000]},
            "stop_token_ids",
        ),
    ],
)
def test_request_refusals_name_the_field_that_caused_them(mini, path, body, param) -> None:
    """Each refusal at the request's level (past the body schema) has the faulty field as its ``param``."""
    status, err = _post(mini[0], path, body)
    assert (status, err["error"]["param"]) == (400, param), err


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(mini, monkeypatch) -> None:
    """2 MiB of a's holds at least 262,144 tokens (no token of DeepSeek's covers more than 8 a's:
    `kvdiet.token_cover`), 2 MiB of Chinese without punctuation (no place to cut it) some 700,000: past
    max_model_len 4096 without tokenizing them (30 MB of either took 30-50 s and 4-11 GB to tokenize, then was
    refused)."""
    base, loop = mini

    def never(text: str) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(loop.engine.tokenizer, "encode", never)
    status, err = _post(base, "/v1/completions", {"prompt": "a" * (2 << 20), "max_tokens": 1})
    assert (status, err["error"]["param"]) == (400, "prompt")
    assert err["error"]["message"] == (
        "prompt (at least 262,145 tokens) + max_tokens (1) = at least 262,146 tokens > max_model_len 4,096; "
        "shorten the prompt or lower max_tokens"
    )
    chat = {"messages": [{"role": "user", "content": "a" * (2 << 20)}], "max_completion_tokens": 5}
    status, err = _post(base, "/v1/chat/completions", chat)
    assert (status, err["error"]["param"]) == (400, "messages")
    assert err["error"]["message"].startswith(
        "prompt (at least 262,148 tokens) + max_tokens (5, sent as max_completion"  # the template's text too
    )
    chinese = "".join(chr(0x4E00 + (i * 7919) % 20902) for i in range(700_000))  # 2.1 MB, no place to cut
    status, err = _post(base, "/v1/completions", {"prompt": chinese, "max_tokens": 1})
    assert (status, err["error"]["param"]) == (400, "prompt")
    assert int(err["error"]["message"].split()[3].replace(",", "")) > 600_000
    monkeypatch.undo()
    status, ok = _post(base, "/v1/completions", {"prompt": "a" * 4000, "max_tokens": 1})  # fits: tokenized
    assert status == 200 and ok["usage"]["prompt_tokens"] < 4096
    _wait_idle(loop)


def test_a_long_text_past_the_context_is_refused_after_its_first_piece(mini, monkeypatch) -> None:
    """Text under the bytes bound but far past the context (300K characters, some 70K tokens, max_model_len
    4096) is tokenized one piece at a time and refused after the first (a 30 MB prompt under a 1M context took
    32 s and 7 GB to tokenize whole, then was refused), its count a lower bound; a completion and a chat alike."""
    from kvdiet.tokenizer import PIECE_CHARS

    base, loop = mini
    tok = loop.engine.tokenizer
    seen: list[int] = []
    whole = tok._ids
    monkeypatch.setattr(tok, "_ids", lambda text: (seen.append(len(text)), whole(text))[1])
    text = "The cache keeps every token. " * 10_345  # 300,005 characters
    status, err = _post(base, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert (status, err["error"]["param"]) == (400, "prompt")
    assert err["error"]["message"].startswith("prompt (at least ")
    assert len(seen) == 1 and PIECE_CHARS <= seen[0] < len(text)  # one piece of two tokenized
    at_least = int(err["error"]["message"].split()[3].replace(",", ""))
    assert at_least == 1 + len(whole(text[: seen[0]])) > 4096
    chat = {"messages": [{"role": "user", "content": text}], "max_completion_tokens": 5}
    status, err = _post(base, "/v1/chat/completions", chat)
    assert (status, err["error"]["param"]) == (400, "messages") and len(seen) == 2
    assert err["error"]["message"].startswith("prompt (at least ")
    _wait_idle(loop)


def test_length_refusals_name_their_field_and_a_max_tokens_never_sent(mini) -> None:
    """A prompt too long for max_model_len 4096 is refused in `LLM.generate`'s words, ``param`` the request's
    own field; a completion that sent no max_tokens is told the 16 is the default (OpenAI's), one that sent 16
    is not; a chat that sent max_completion_tokens is told so; a logit_bias key that is no token id names
    logit_bias, an empty stop string names stop."""
    base, loop = mini
    ids = [5] * 4090
    cases = (
        (
            "/v1/completions",
            {"prompt": ids},
            "prompt",
            "max_tokens (16, the default when a completion gives none)",
        ),
        ("/v1/completions", {"prompt": ids, "max_tokens": 16}, "prompt", "max_tokens (16) = 4,106 tokens"),
        ("/v1/completions", {"prompt": ids, "max_tokens": None}, "prompt", "max_tokens (16, the default"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9999},
            "messages",
            "+ max_tokens (9,999) = ",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9999},
            "messages",
            "+ max_tokens (9,999, sent as max_completion_tokens) = ",
        ),
        (  # a chat that fills the context unasked: the one token any reply takes, in the same words
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "tok " * 5000}]},
            "messages",
            "+ max_tokens (1, the least a reply takes) = ",
        ),
        ("/v1/completions", {"prompt": [1], "logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be"),
        *(
            ("/v1/completions", {"prompt": [1], "logit_bias": {key: 1}}, "logit_bias", f"got {key!r}")
            for key in ("+63", "063", "6_3", " 63", "\u0666\u0663", "-1")
        ),  # a key past int()'s 4,300 digits is named as any other, not with Python's own ValueError
        (
            "/v1/completions",
            {"prompt": [1], "logit_bias": {"1" * 4301: 1}},
            "logit_bias",
            "keys must be token ids",
        ),
        ("/v1/completions", {"prompt": [1], "stop": ""}, "stop", "stop strings must be non-empty"),
        ("/v1/completions", {"prompt": [1], "stop": ["a", ""]}, "stop", "stop strings must be non-empty"),
    )
    for path, body, param, message in cases:
        status, err = _post(base, path, body)
        assert status == 400 and err["error"]["param"] == param, (body, err)
        assert message in err["error"]["message"], err
        length = "shorten the prompt or lower max_tokens" in err["error"]["message"]
        assert length == (param in ("prompt", "messages")), err
    assert not loop.engine.requests


def test_json_types_are_strict_where_a_number_means_a_count(mini) -> None:
    """Every count is a JSON integer and every other number a JSON number, as OpenAI types them ("16", "0.5"
    and true are refused; 1 is a number); a NaN or infinite logit_bias is named as not finite, as temperature's
    is."""
    base, loop = mini
    for body, needle in (
        ({"prompt": [1], "max_tokens": "2"}, "max_tokens: Input should be a valid integer"),
        ({"prompt": [1], "max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"prompt": [1], "max_tokens": 1, "top_k": "3"}, "top_k: Input should be a valid integer"),
        ({"prompt": [1], "max_tokens": 1, "seed": "1"}, "seed: Input should be a valid integer"),
        ({"prompt": [1], "max_tokens": 1, "n": True}, "n: Input should be a valid integer"),
        (
            {"prompt": [1], "max_tokens": 1, "temperature": "0.5"},
            "temperature: Input should be a valid number",
        ),
        ({"prompt": [1], "max_tokens": 1, "top_p": True}, "top_p: Input should be a valid number"),
        ({"prompt": [1], "max_tokens": 1, "logit_bias": {"5": "7"}}, "Input should be a valid number"),
        ({"prompt": [1], "max_tokens": 1, "logit_bias": {"5": True}}, "Input should be a valid number"),
        (b'{"prompt": [1], "max_tokens": 1, "logit_bias": {"5": NaN}}', "finite number"),
        (b'{"prompt": [1], "max_tokens": 1, "logit_bias": {"5": -Infinity}}', "finite number"),
    ):
        status, err = _post(base, "/v1/completions", body)
        assert status == 400 and needle in err["error"]["message"], (body, err)
    status, err = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "max_completion_tokens": "3"})  # fmt: skip
    assert status == 400 and "max_completion_tokens" in err["error"]["message"], err
    status, ok = _post(
        base, "/v1/completions", {"prompt": [1], "max_tokens": 1, "temperature": 1, "top_p": 1}
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 1, ok
    assert not loop.engine.requests


def test_switches_are_json_booleans_and_null_is_the_default(mini) -> None:
    """A switch is a JSON boolean ("yes", 1 and "true" refused, as OpenAI types them); null for a nullable
    field (OpenAI's temperature, top_p, n, stream, stream_options.include_usage; vLLM's top_k,
    return_token_ids) runs as its default does; an unknown or unsupported field is the error's param."""
    base, loop = mini
    for body in (
        {"stream": "yes"},
        {"stream": 1},
        {"ignore_eos": "true"},
        {"skip_special_tokens": 0},
        {"return_token_ids": "no"},
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        {"ignore_eos": None},  # not nullable in vLLM either
    ):
        status, err = _post(base, "/v1/completions", {"prompt": [1], "max_tokens": 1, **body})
        assert status == 400 and "Input should be a valid boolean" in err["error"]["message"], (body, err)
    nulls = {
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "n": None,
        "stream": None,
        "return_token_ids": None,
    }
    status, with_nulls = _post(
        base, "/v1/completions", {"prompt": [3, 4], "max_tokens": 3, "seed": 7, **nulls}
    )
    status_plain, plain = _post(base, "/v1/completions", {"prompt": [3, 4], "max_tokens": 3, "seed": 7})
    assert status == status_plain == 200, with_nulls
    assert with_nulls["choices"][0]["text"] == plain["choices"][0]["text"]  # temperature 1, seed 7
    # OpenAI's fields at their no-op values, as SDK code sends them (were 400 "unknown field(s)")
    noop = {"store": False, "metadata": {}, "parallel_tool_calls": False, "service_tier": "auto", "tools": []}
    noop |= {"tool_choice": "none", "response_format": {"type": "text"}}
    status, with_noop = _post(base, "/v1/completions", {"prompt": [3, 4], "max_tokens": 3, "seed": 7, **noop})
    assert status == 200 and with_noop["choices"][0]["text"] == plain["choices"][0]["text"], with_noop
    for body, param in (
        ({"foo": 1, "bar": 2}, "bar"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"echo": True}, "echo"),
        ({"store": True}, "store"),
        ({"metadata": {"k": "v"}}, "metadata"),
        ({"service_tier": "flex"}, "service_tier"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),  # a tool to call: not a no-op
        ({"tools": {}}, "tools"),
    ):
        status, err = _post(base, "/v1/completions", {"prompt": [1], "max_tokens": 1, **body})
        assert (status, err["error"]["param"]) == (400, param), err
    assert not loop.engine.requests


@pytest.mark.parametrize(
    ("data", "content_type", "message"),
    [
        (
            b'{"prompt": [1], "max_tokens": 1}',
            "text/plain",
            "the body must be JSON sent with Content-Type: application/json (got Content-Type: text/plain)",
        ),
        (  # curl -d without -H
            b'{"prompt": [1], "max_tokens": 1}',
            "application/x-www-form-urlencoded",
            "the body must be JSON sent with Content-Type: application/json "
            "(got Content-Type: application/x-www-form-urlencoded)",
        ),
        (
            b'{"prompt": [1], "max_tokens": 1}',
            None,
            "the body must be JSON sent with Content-Type: application/json (got no Content-Type)",
        ),
        (
            b'{"prompt": "caf\xe9", "max_tokens": 1}',  # Latin-1, not UTF-8
            "application/json",
            "the body is not UTF-8: byte(s) e9 at offset 15 (JSON bodies must be UTF-8)",
        ),
        (
            b'{"prompt": [1],\n "max_tokens": 1,,}',
            "application/json",
            "malformed JSON body: Expecting property name enclosed in double quotes at line 2 column 18 (char 33)",
        ),
        (b"[1, 2]", "application/json", "the body must be a JSON object (got an array of 2 items)"),
        (b"", "application/json", "empty body: send a JSON object with Content-Type: application/json"),
    ],
)
def test_a_body_that_cannot_be_read_says_why(
    mini, data: bytes, content_type: str | None, message: str
) -> None:
    """A body that is not a JSON object (in UTF-8, sent as application/json) is a 400 saying which of these it
    failed, instead of pydantic's "Input should be a valid dictionary" or FastAPI's "error parsing the body"."""
    base, loop = mini
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, err = _post(base, path, data, {"Content-Type": content_type})
        assert (status, err["error"]["message"]) == (400, message), err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == 400
    assert not loop.engine.requests


def test_a_chat_max_tokens_that_contradicts_max_completion_tokens_is_refused(mini) -> None:
    """``max_tokens`` 3 and ``max_completion_tokens`` 2 was served with 2: a 400 naming both; equal values pass,
    and ``tools: []`` (SDK code sends it) is a no-op on a chat too."""
    base, loop = mini
    chat = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    status, err = _post(base, "/v1/chat/completions", {**chat, "max_tokens": 3, "max_completion_tokens": 2})
    assert status == 400 and err["error"]["param"] == "max_tokens", err
    assert err["error"]["message"] == (
        "max_tokens (3) and max_completion_tokens (2) differ: give one "
        "(max_tokens is deprecated in favour of max_completion_tokens)"
    )
    status, ok = _post(base, "/v1/chat/completions", {**chat, "max_tokens": 2, "max_completion_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2, ok
    status, ok = _post(base, "/v1/chat/completions", {**chat, "max_completion_tokens": 2, "tools": []})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2, ok
    assert not loop.engine.requests


def test_prompt_token_id_errors_read_as_llm_generate_words_them(mini) -> None:
    """The same fault, the same message as `LLM.generate` (test_engine_llm): no ``prompt:`` prefix on one
    kind and not the other; ``param`` names the field."""
    base, _ = mini
    for prompt, message in (
        ([0, 129280], "token id 129280 at index 1 is outside the vocabulary [0, 129280)"),
        ([1.5, 2], "token id 1.5 at index 0 is not an integer"),
        ([[2, 0.5]], "token id 0.5 at index 1 is not an integer"),
    ):
        status, err = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert (status, err["error"]["message"], err["error"]["param"]) == (400, message, "prompt")


def test_the_openai_client_sees_a_bad_request_error(client) -> None:
    with pytest.raises(openai.BadRequestError, match="max_model_len 4,096"):
        client.completions.create(model="v4.1-mini", prompt="x", max_tokens=4095)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(mini, stream) -> None:
    base, loop = mini
    _wait_idle(loop)
    free = loop.engine.runner.pool.blocks.num_free
    aborted = loop.engine.stats.finished["abort"]
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": "disconnect " * 100, "max_tokens": 500, "stream": stream, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the first chunk arrived: the request is running
    else:
        deadline = time.monotonic() + 60
        while not loop.engine.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.engine.requests
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _wait_idle(loop)
    assert loop.engine.stats.finished["abort"] == aborted + 1
    assert loop.engine.runner.pool.blocks.num_free == free
    loop.engine.runner.pool.blocks.check_integrity()  # safe: the engine thread is idle


def test_api_key_and_a_dead_engine(tmp_path: Path) -> None:
    args = EngineArgs(model="v4.1-micro", cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20))
    with running_server(args, "micro", api_key="s3cret") as (base, loop):
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        status, err = _post(base, "/v1/completions", body)
        assert status == 401 and err["error"]["type"] == "authentication_error"
        assert _post(base, "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        for header in ("Basic s3cret", "Bearers3cret", "Bearer s3cret2", "s3cret"):
            assert _post(base, "/v1/completions", body, {"Authorization": header})[0] == 401, header
        for header in ("bearer s3cret", "BEARER  s3cret"):  # the scheme is case-insensitive (RFC 9110)
            assert _post(base, "/v1/completions", body, {"Authorization": header})[0] == 200, header
        status, ok = _post(base, "/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert status == 200 and ok["usage"]["completion_tokens"] == 2
        assert _get(base, "/health")[0] == 200 and _get(base, "/metrics")[0] == 200  # not behind the key
        # a caller without the key gets its 401 before any of its body is read (a body over the cap: not a 413)
        from kvdiet.server.app import MAX_BODY_BYTES

        big = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()
        assert _post(base, "/v1/completions", big)[0] == 401
        c = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="micro", prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1

        def broken() -> list:
            raise RuntimeError("injected failure")

        loop.engine.step = broken
        status, err = _post(base, "/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert status == 503 and "injected failure" in err["error"]["message"]
        assert _get(base, "/health")[0] == 503
        status, err = _post(base, "/v1/completions", body, {"Authorization": "Bearer s3cret"})
        assert status == 503


def test_an_empty_api_key_is_no_key() -> None:
    """``KVDIET_API_KEY=`` or ``--api-key ''`` (as vLLM reads it): no authentication, not a key only an empty
    ``Authorization: Bearer`` header matches; a non-empty key still needs the header."""
    args = EngineArgs(model="v4.1-micro", cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20))
    with running_server(args, "micro", api_key="") as (base, _):
        status, text = _get(base, "/v1/models")
        assert status == 200 and json.loads(text)["data"][0]["id"] == "micro", text
    with running_server(args, "micro", api_key="k") as (base, _):
        status, text = _get(base, "/v1/models")
        assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error", text


def test_a_model_without_a_tokenizer_returns_token_ids_unasked() -> None:
    """v4.1-micro has no text to give: its completions carry ``token_ids`` (and ``prompt_token_ids``) without
    ``return_token_ids``, streamed or not, so a client does not see only ``""``; the OpenAI client parses them."""
    args = EngineArgs(model="v4.1-micro", cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20))
    with running_server(args, "micro") as (base, loop):
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        want = _solo(loop, [5, 6, 7], 3)
        r = c.completions.create(model="micro", prompt=[5, 6, 7], max_tokens=3, temperature=0)
        (choice,) = r.choices
        assert (choice.text, choice.model_extra["token_ids"], choice.finish_reason) == ("", want, "length")
        assert r.model_extra["prompt_token_ids"] == [5, 6, 7]
        chunks = list(
            c.completions.create(model="micro", prompt=[5, 6, 7], max_tokens=3, temperature=0, stream=True)
        )
        assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == want
        assert not any("prompt_token_ids" in ch.model_extra for ch in chunks)  # unstreamed only (README)


def test_a_model_without_a_tokenizer_refuses_stop_strings_and_chat_by_field() -> None:
    """v4.1-micro has no tokenizer: stop strings are refused against ``stop`` (the prompt is fine), and chat,
    which has no template without one, names no field (none of the body's would fix it)."""
    args = EngineArgs(model="v4.1-micro", cache=CacheOptions(block_size=4, kv_cache_memory=1 << 20))
    with running_server(args, "micro") as (base, loop):
        status, err = _post(base, "/v1/completions", {"prompt": [1, 2, 3], "stop": ["x"]})
        assert (status, err["error"]["param"]) == (400, "stop"), err
        assert err["error"]["message"].startswith("stop strings need a tokenizer")
        status, err = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert (status, err["error"]["param"]) == (400, None), err
        assert "no tokenizer" in err["error"]["message"]
        status, ok = _post(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0})
        assert status == 200 and ok["choices"][0]["token_ids"] == _solo(loop, [1, 2, 3], 1)


def test_metrics_export_the_global_pool_as_its_own_tier() -> None:
    """Each tier's counters under its own ``tier`` label: distinct numbers per tier, so a mix-up shows."""
    import dataclasses

    from kvdiet.cache.counters import TierCounters
    from kvdiet.engine.engine_snapshot import EngineSnapshot

    def tier(base: int) -> TierCounters:
        return TierCounters(*(base + i for i in range(len(dataclasses.fields(TierCounters)))))

    snap = EngineSnapshot(
        *([1] * 9),
        device=tier(100),
        persistent=tier(200),
        swa_pool=tier(300),
        global_pool=tier(400),
        replayed_tokens=0,
        computed_tokens=0,
        snapshot_restores=0,
        snapshots_stored=0,
        persistent_bytes=0,
        persistent_entries=0,
        swa_pool_bytes=0,
        swa_pool_entries=0,
    )
    text = ServerMetrics(lambda: snap, "m").render().decode()
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if "tier" in s.labels
    }
    g = snap.global_pool
    assert samples[("kvdiet:prefix_cache_queries_total", "global_pool")] == g.query_tokens == 400
    assert samples[("kvdiet:prefix_cache_hits_total", "global_pool")] == g.hit_tokens == 401
    assert samples[("kvdiet:prefix_cache_hits_total", "persistent")] == 201
    assert samples[("kvdiet:cache_corrupt_dropped_total", "global_pool")] == g.corrupt_dropped
    assert samples[("kvdiet:cache_backend_errors_total", "global_pool")] == g.backend_errors == 411
    assert ("kvdiet:cache_backend_errors_total", "persistent") not in samples  # a local tier
    assert samples[("kvdiet:cache_read_errors_total", "persistent")] == snap.persistent.read_errors == 212


def test_long_prompts_queue_on_their_own_thread_and_never_hold_up_short_ones() -> None:
    """Ten long prompts (each held 0.3 s here; a text with no place to cut takes up to a minute) wait on the one
    thread kept for long texts, not on the default pool's few threads: a short prompt's preparation beside them
    runs at once (it waited 17 s behind ten 4.5 MB prompts)."""
    import threading

    from kvdiet.server import routes

    def prepare(tag: str) -> tuple[str, str]:
        if tag == "long":
            time.sleep(0.3)
        return tag, threading.current_thread().name

    async def main() -> tuple[list, float]:
        big = routes.HELD_CHARS + 1
        longs = [asyncio.ensure_future(routes._prepared_in_worker(big, prepare, "long")) for _ in range(10)]
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        short = await routes._prepared_in_worker(10, prepare, "short")
        waited = time.perf_counter() - start
        return [short, *await asyncio.gather(*longs)], waited

    results, waited = asyncio.run(main())
    assert waited < 0.25  # not behind even one long prompt
    assert results[0][0] == "short" and not results[0][1].startswith("kvdiet-long-text")
    assert {name for _, name in results[1:]} == {"kvdiet-long-text_0"}  # one thread, in turn
