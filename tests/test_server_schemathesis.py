"""The server against bad input: ``kvdiet serve`` as a process on a free loopback port, its OpenAPI schema
fuzzed by schemathesis (bounded, derandomized examples per operation, valid and invalid bodies): no answer in
the 5xx range, every 4xx with an OpenAI error body; and the inputs that once got a 500 or a confusing 400.

The model is v4.1-micro with the DeepSeek vocabulary (so text prompts and chat go through the real
tokenizer) and ``--max-model-len 32`` (so any accepted request is milliseconds of compute).
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvdiet.config import config_dir

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 100  # per operation and mode: about 20 s for the whole module on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvdiet serve`` on v4.1-micro with the real tokenizer's vocabulary; stopped with SIGINT, and its log
    must hold no traceback."""
    tmp = tmp_path_factory.mktemp("fuzz")
    cfg = json.loads((config_dir() / "v4.1-micro.json").read_text())
    cfg["text_config"] |= {"vocab_size": 129_280, "engram_compressed_vocab_size": 99_092}
    (tmp / "config.json").write_text(json.dumps(cfg))
    port = _free_port()
    cmd = [sys.executable, "-m", "kvdiet.cli", "serve", "--model", str(tmp / "config.json")]
    cmd += ["--port", str(port), "--max-model-len", "32", "--block-size", "4", "--kv-cache-memory", "1MiB"]
    cmd += ["--persistent-dir", "none", "--log-level", "warning"]
    log = tmp / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text


def _post(base: str, path: str, body: bytes) -> tuple[int, dict]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, {"raw": raw.decode(errors="replace")}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schemathesis_finds_no_5xx_and_every_4xx_is_an_openai_error(
    base_url: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    names = {f"{op.method.upper()} {op.path}" for op in operations}
    assert names >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"}
    for op in operations:
        if mode is GenerationMode.NEGATIVE and op.method.upper() != "POST":
            continue  # a GET without parameters has nothing to make invalid

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            status = response.status_code
            sent = f"{case.method} {case.path} {case.body!r:.300}"
            assert status < 500, f"{sent} -> {status} {response.text[:300]}"
            if 400 <= status < 500:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, f"{sent} -> {response.text[:300]}"
                assert error["code"] == status and isinstance(error["message"], str) and error["message"]

        check()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "bad \\ud800 surrogate", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["bad \\udfff"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "bad \\ud800 surrogate"}], "max_tokens": 1}',
            "messages.0.content",  # the text's own path (it was "messages", the character's place in the template)
        ),
    ],
)
def test_an_unpaired_surrogate_is_a_400_naming_it(base_url: str, path: str, body: str, param: str) -> None:
    """Valid JSON but not valid Unicode text: a 400 with an OpenAI error body, never a 500."""
    status, out = _post(base_url, path, body.encode())
    assert status == 400, out
    error = out["error"]
    assert "not valid Unicode: unpaired surrogate U+D" in error["message"], error
    assert error["message"].endswith(" at character 4"), error  # in the text as sent, not a rendered template
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)


def test_a_surrogate_in_a_field_name_is_a_400(base_url: str) -> None:
    status, out = _post(base_url, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1, "\\ud800x": 1}')
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/v1/completions",
            {"prompt": {"text": "hi"}},
            "prompt: must be a string, a list of token ids (integers), or a one-element list of either "
            "(got an object)",
        ),
        (
            "/v1/completions",
            {"prompt": ["a", None]},  # no number in it: [1, "a"] names its item (test_server_app)
            "prompt: must be a string, a list of token ids (integers), or a one-element list of either "
            "(got an array of 2 items)",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": "x" * 1025},
            "stop: must be a string of at most 1,024 characters or a list of at most 16 such strings "
            "(got a string of 1,025 characters)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content: must be a string or a list of content parts (objects) (got a number)",
        ),
    ],
)
def test_a_wrong_type_in_a_union_field_is_one_sentence(
    base_url: str, path: str, body: dict, message: str
) -> None:
    status, out = _post(base_url, path, json.dumps(body).encode())
    assert status == 400 and out["error"]["message"] == message, out


_USER = {"role": "user", "content": "x"}
_TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages.0.content.0.text",
            "messages.0.content.0.text: Input should be a valid string",
        ),
        (
            [
                _USER,
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None}]},
            ],
            "messages.1.content.1.text",
            "messages.1.content.1.text: Input should be a valid string",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages.0.content.0",
            'messages.0.content.0: only text parts are supported (got type "image_url")',
        ),
        ([{"role": "user"}], "messages.0.content", "messages.0.content: Field required"),
        (  # OpenAI's schema: minItems 1 (a string, even empty, is the way to send no text)
            [_USER, {"role": "user", "content": []}],
            "messages.1.content",
            "messages.1.content: must not be an empty array: give a string or at least one content part",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {}}]}],
            "messages.0.content.0.prompt_cache_breakpoint.mode",
            "messages.0.content.0.prompt_cache_breakpoint.mode: Field required",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "a",
                            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "1h"},
                        }
                    ],
                }
            ],
            "messages.0.content.0.prompt_cache_breakpoint.ttl",
            "messages.0.content.0.prompt_cache_breakpoint.ttl: Input should be '30m' or '12h'",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
                }
            ],
            "messages.0.content.0.cache_control",
            "messages.0.content.0.cache_control: Extra inputs are not permitted",
        ),
        ([{"role": "system"}, _USER], "messages.0.content", "messages.0.content: Field required"),
        ([_USER, {"role": "assistant"}, _USER], "messages.1.content", "messages.1.content: Field required"),
        (
            [{"role": "user", "content": None}],
            "messages.0.content",
            "messages.0.content: must be a string or a list of content parts (objects) (got null)",
        ),
        (
            [{"role": "user", "content": "x", "foo": 1}],
            "messages.0.foo",
            "messages.0.foo: Extra inputs are not permitted",
        ),
        (
            [{"role": "assistant", "content": "a", "tool_calls": [{"id": "c", "type": "function"}]}, _USER],
            "messages.0.tool_calls",
            "messages.0.tool_calls: tool calls are not supported by kvdiet (only null or [] is taken)",
        ),
        (  # the OpenAI SDK's tool-call turn sent back: null content is OpenAI's rule beside tool_calls
            [_USER, {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]}, _USER],
            "messages.1.tool_calls",
            "messages.1.tool_calls: tool calls are not supported by kvdiet (only null or [] is taken)",
        ),
        (
            [_USER, {"role": "assistant", "function_call": _TOOL_CALL["function"]}, _USER],
            "messages.1.function_call",
            "messages.1.function_call: function calls are not supported by kvdiet (only null or [] is taken)",
        ),
        (  # a content bad in itself is named too, after the tool key
            [{"role": "assistant", "content": 5, "tool_calls": [_TOOL_CALL]}, _USER],
            "messages.0.tool_calls",
            "messages.0.tool_calls: tool calls are not supported by kvdiet (only null or [] is taken); "
            "messages.0.content: must be a string or a list of content parts (objects) (got a number)",
        ),
        (
            [{"role": "assistant", "content": "a", "refusal": "no"}, _USER],
            "messages.0.refusal",
            "messages.0.refusal: refusals are not supported by kvdiet (only null or [] is taken)",
        ),
        (
            [{"role": "tool", "content": "x"}],
            "messages.0.role",
            "messages.0.role: role 'tool' is not supported (system, developer, user, assistant)",
        ),
    ],
)
def test_a_bad_chat_message_is_a_400_naming_its_path(
    base_url: str, messages: list, param: str, message: str
) -> None:
    """Every chat message has a role and a content (a string or text parts: OpenAI's rule without
    tool_calls) and no other key but ``name`` and OpenAI's assistant keys left empty; a fault is a 400 whose
    ``param`` is its path, as any other schema error's is (``messages.0.content.0.text``), and whose message
    starts with that path."""
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    status, out = _post(base_url, "/v1/chat/completions", body)
    assert status == 400, out
    assert (out["error"]["param"], out["error"]["message"]) == (param, message), out


def test_a_chat_message_may_name_its_participant(base_url: str) -> None:
    """``name`` is accepted, as OpenAI's chat API takes it on every message; DeepSeek's template has no place
    for it, so the prompt and the greedy reply are those without it."""
    outs = []
    for extra in ({}, {"name": "ada"}):
        body = {"messages": [{"role": "user", "content": "The KV cache", **extra}], "max_tokens": 2}
        status, out = _post(base_url, "/v1/chat/completions", json.dumps(body | {"temperature": 0}).encode())
        assert status == 200, out
        outs.append((out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]))
    assert outs[0] == outs[1] and outs[0][0] > 3


def test_a_text_part_may_carry_the_sdks_optional_keys(base_url: str) -> None:
    """Every key the installed OpenAI SDK lets a text part carry is taken (``prompt_cache_breakpoint``, a
    prefix-cache hint: kvdiet caches every prompt's whole blocks anyway), and the prompt and greedy reply are
    those without it; an image part is still refused by its path."""
    from openai.types.chat import ChatCompletionContentPartText, ChatCompletionContentPartTextParam

    from kvdiet.engine.chat_messages import TextPart

    sdk_keys = (
        ChatCompletionContentPartTextParam.__required_keys__
        | ChatCompletionContentPartTextParam.__optional_keys__
    )
    assert sdk_keys == set(TextPart.model_fields) == {"type", "text", "prompt_cache_breakpoint"}
    plain = {"type": "text", "text": "The KV cache"}
    returned = ChatCompletionContentPartText(
        type="text", text="The KV cache"
    ).model_dump()  # breakpoint: null
    outs = []
    for part in (
        plain,
        returned,
        plain | {"prompt_cache_breakpoint": {"mode": "explicit"}},
        plain | {"prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}},
        plain | {"prompt_cache_breakpoint": {"mode": "explicit", "ttl": None}},
    ):
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2, "temperature": 0}
        status, out = _post(base_url, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, (part, out)
        outs.append((out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]))
    assert len(set(outs)) == 1 and outs[0][0] > 3
    image = {"type": "image_url", "image_url": {"url": "x"}, "prompt_cache_breakpoint": {"mode": "explicit"}}
    body = {"messages": [{"role": "user", "content": [plain, image]}], "max_tokens": 1}
    status, out = _post(base_url, "/v1/chat/completions", json.dumps(body).encode())
    assert (status, out["error"]["param"]) == (400, "messages.0.content.1"), out
    assert (
        out["error"]["message"]
        == 'messages.0.content.1: only text parts are supported (got type "image_url")'
    )


def test_a_reply_sent_back_as_the_openai_sdk_dumps_it_is_taken(base_url: str) -> None:
    """The OpenAI SDK's ``message.model_dump()`` of a reply carries its unused keys as null (``refusal``,
    ``tool_calls``, ``function_call``, ``audio``, ``annotations``); a conversation that sends it back gets the
    same prompt and greedy reply as one that sends only role and content."""
    reply = {"role": "assistant", "content": "fine"}
    dumped = reply | dict.fromkeys(("refusal", "tool_calls", "function_call", "audio", "annotations"))
    outs = []
    for sent in (reply, dumped, reply | {"tool_calls": [], "annotations": []}):
        messages = [{"role": "user", "content": "The KV cache"}, sent, _USER]
        body = {"messages": messages, "max_tokens": 2, "temperature": 0}
        status, out = _post(base_url, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, out
        outs.append((out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]))
    assert outs[0] == outs[1] == outs[2] and outs[0][0] > 5


def test_the_server_still_serves_after_the_fuzzing(base_url: str) -> None:
    status, out = _post(base_url, "/v1/completions", b'{"prompt": "The KV cache", "max_tokens": 2}')
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
