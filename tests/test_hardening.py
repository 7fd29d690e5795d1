"""Issue 25 hardening, end to end against a real uvicorn server on 127.0.0.1 (as test_server.py):
bad input is a 4xx in the OpenAI error shape, never a 5xx, and one request cannot hurt another."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from clover.engine import Engine, EngineOptions
from clover.server.app import create_app
from test_server import (MODEL, TIMEOUT, Server, check_error, model, model_dir,  # noqa: F401 (fixtures)
                         post, slow_forwards, tokenizer, wait_for)

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

JSON = {"content-type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def start(model, tokenizer, app_options=None, **options):
    """A server with the default 1 MiB body limit (deep nesting needs room) and `create_app` options."""
    engine = Engine(model, EngineOptions(**options))
    return Server(create_app(engine, tokenizer, MODEL, **(app_options or {}))), engine


@pytest.fixture(scope="module")
def served(model, tokenizer):
    server, engine = start(model, tokenizer, max_batch=8, max_queue=16)
    yield server, engine
    assert server.stop()


def server_errors(server) -> float:
    """Sum of the 5xx answers the server has counted in /metrics."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("clover_http_requests_total{") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def alive(server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- bad input: 4xx, never 5xx ---------------------------------------------------------------------
@pytest.mark.parametrize("depth", [100, 10_000, 100_000])
def test_deeply_nested_json_is_a_400(served, depth):
    server, _ = served
    before = server_errors(server)
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1, "metadata": ' + nested + b"}"
    check_error(post(server, "/v1/completions", content=body, headers=JSON), 400, None, ["nests deeper"])
    assert server_errors(server) == before
    alive(server)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\udfff"}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\ud83d"]}'),
])
def test_lone_surrogate_is_a_400(served, path, body):
    server, _ = served
    before = server_errors(server)
    check_error(post(server, path, content=body.encode(), headers=JSON), 400, None, ["surrogate"])
    assert server_errors(server) == before


@pytest.mark.parametrize("seed", [2 ** 64, 10 ** 30, -(2 ** 63) - 1])
def test_seed_out_of_range_is_a_400(served, seed):
    server, _ = served
    before = server_errors(server)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0.7, "seed": seed}
    check_error(post(server, "/v1/completions", body), 400, "seed", ["seed must lie in"])
    assert server_errors(server) == before


def test_largest_seed_is_accepted(served):
    server, _ = served
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0.7, "seed": 2 ** 64 - 1}
    assert post(server, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("headers, content", [
    ({"content-type": "text/plain"}, json.dumps(CHAT).encode()),
    ({"content-type": "application/x-www-form-urlencoded"}, json.dumps(CHAT).encode()),
    ({"content-type": "multipart/form-data; boundary=x"}, json.dumps(CHAT).encode()),
    ({}, json.dumps(CHAT).encode()),
    ({"content-type": "application/json; charset=utf-16"}, json.dumps(CHAT).encode("utf-16")),
])
def test_non_json_content_type_is_a_415_and_not_executed(served, headers, content):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    r = httpx.post(server.url + "/v1/chat/completions", content=content, headers=headers, timeout=TIMEOUT)
    check_error(r, 415, None, ["application/json"])
    assert engine.metrics.value("clover_engine_steps_total") == steps          # nothing ran


def test_utf16_body_declared_as_json_is_a_400(served):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    check_error(post(server, "/v1/chat/completions", content=json.dumps(CHAT).encode("utf-16"), headers=JSON),
                400, None, ["UTF-8"])
    assert engine.metrics.value("clover_engine_steps_total") == steps


def test_json_with_charset_utf8_is_accepted(served):
    server, _ = served
    r = post(server, "/v1/chat/completions", content=json.dumps(CHAT).encode(),
             headers={"content-type": "application/json; charset=UTF-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("tool_choice", ["auto", "none", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_without_tools_is_a_400(served, tool_choice):
    server, _ = served
    check_error(post(server, "/v1/chat/completions", dict(CHAT, tool_choice=tool_choice)), 400, "tool_choice",
                ["tool_choice"])


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/chat/completions", {"POST"}),
    ("PUT", "/v1/completions", {"POST"}),
    ("POST", "/health", {"GET", "HEAD"}),
    ("DELETE", "/v1/models", {"GET", "HEAD"}),
])
def test_405_names_the_allowed_methods(served, method, path, allowed):
    server, _ = served
    r = httpx.request(method, server.url + path, timeout=TIMEOUT)
    check_error(r, 405)
    assert {m.strip() for m in r.headers["allow"].split(",")} >= allowed - {"HEAD"}
    assert method not in r.headers["allow"]


# ---- poison sampling values: a 400 naming the field (they used to fail the whole running batch) --------
@pytest.mark.parametrize("change, param", [
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
    ({"top_p": 1e-46}, "top_p"),
    ({"temperature": 0.7, "dllm_length_penalty_strength": 1e308}, "dllm_length_penalty_strength"),
    ({"temperature": 0.7, "dllm_repetition_penalty": 1e-300}, "dllm_repetition_penalty"),
    ({"dllm_repetition_window": 1.0}, "dllm_repetition_window"),          # these two found by
    ({"block_expert_top_p": 1e-45}, "block_expert_top_p"),                # tests/test_fuzz_server.py
])
def test_poison_sampling_values_are_a_400(served, change, param):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    check_error(post(server, "/v1/chat/completions", dict(CHAT, **change)), 400, param, [param])
    assert engine.metrics.value("clover_engine_steps_total") == steps
    alive(server)


# ---- bounded per-request compute: a documented maximum block size ----------------------------------
def test_block_size_above_the_maximum_is_a_400(served):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "block_size": 65536}
    check_error(post(server, "/v1/completions", body), 400, "block_size", ["max_block_size 1024"])
    check_error(post(server, "/v1/completions", dict(body, block_size=8, max_block_size=1 << 20)), 400,
                "max_block_size", ["unknown field"])                # a request cannot raise the cap
    assert engine.metrics.value("clover_engine_steps_total") == steps


def test_the_maximum_block_size_is_configurable(model, tokenizer):
    server, _ = start(model, tokenizer, {"max_block_size": 4})
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        assert post(server, "/v1/completions", dict(body, block_size=4)).status_code == 200
        check_error(post(server, "/v1/completions", dict(body, block_size=8)), 400, "block_size",
                    ["max_block_size 4"])
    finally:
        assert server.stop()


def test_default_maximum_block_size_is_1024():
    from clover.generation.settings import GenerationSettings, GenerationSettingsError

    assert GenerationSettings.resolve(block_size=1024).block_size == 1024
    with pytest.raises(GenerationSettingsError, match="block_size must be <= max_block_size 1024"):
        GenerationSettings.resolve(block_size=1025)
    assert GenerationSettings.resolve({"max_block_size": 4096}, block_size=2048).block_size == 2048


# ---- a client that leaves, and large bodies ----------------------------------------------------------
def status_count(server, route, status) -> float:
    needle = f'clover_http_requests_total{{route="{route}",status="{status}"}} '
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(needle):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_non_streaming_client_that_hangs_up_is_a_499_not_a_500(served, slow_forwards, caplog):
    server, engine = served
    errors, gone = server_errors(server), status_count(server, "/v1/completions", 499)
    cancelled = engine.metrics.value("clover_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "prompt": "Impatient", "max_tokens": 400, "block_size": 1, "ignore_eos": True}
    with caplog.at_level(logging.ERROR):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        wait_for(lambda: engine.metrics.value("clover_requests_total", finish_reason="cancelled") == cancelled + 1)
        wait_for(lambda: status_count(server, "/v1/completions", 499) == gone + 1)
    assert server_errors(server) == errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path, attribute", [("/v1/chat/completions", "apply_chat_template"),
                                             ("/v1/completions", "encode")])
def test_tokenizing_does_not_block_the_event_loop(served, tokenizer, monkeypatch, path, attribute):
    """While one request's (slow) tokenization runs, /health still answers at once."""
    server, _ = served
    real, started = getattr(tokenizer, attribute), threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, attribute, slow)
    body = CHAT if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "slow", "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, path, body)
        assert started.wait(TIMEOUT)
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
        waited = time.perf_counter() - t0
        assert pending.result(TIMEOUT).status_code == 200
    assert waited < 1.0, f"/health waited {waited:.2f}s behind a tokenization"



# ---- access: API key and allowed hosts -------------------------------------------------------------
KEY = "sk-test-4f9a"


@pytest.fixture(scope="module")
def guarded(model, tokenizer):
    server, engine = start(model, tokenizer, {"api_key": KEY, "allowed_hosts": ["127.0.0.1", "localhost", "[::1]",
                                                                           "*.internal.test"]})
    yield server, engine
    assert server.stop()


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny"), ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/redoc"),
    ("GET", "/openapi.json"), ("GET", "/v1/nothing"),
])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY])
def test_api_key_is_required(guarded, method, path, authorization):
    server, engine = guarded
    steps = engine.metrics.value("clover_engine_steps_total")
    headers = dict(JSON, **({"authorization": authorization} if authorization else {}))
    r = httpx.request(method, server.url + path, headers=headers, content=json.dumps(CHAT), timeout=TIMEOUT)
    err = check_error(r, 401, None, ["API key"])
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert engine.metrics.value("clover_engine_steps_total") == steps


def test_the_right_key_is_accepted_and_health_stays_open(guarded):
    server, _ = guarded
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client().models.list()                            # its api_key is "x"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/metrics", headers=auth).status_code == 200
    assert httpx.get(server.url + "/openapi.json", headers=auth).status_code == 200
    assert 'status="401"' in httpx.get(server.url + "/metrics", headers=auth).text   # refusals are counted


@pytest.mark.parametrize("host", ["evil.example", "attacker.test:8000", "127.0.0.1.evil.example", "[::2]:80",
                                  "internal.test.evil.example", "xinternal.test"])
def test_other_host_headers_are_refused(guarded, host):
    server, _ = guarded
    r = httpx.get(server.url + "/health", headers={"host": host})
    check_error(r, 400, None, ["Host header"])
    r = httpx.get(server.url + "/v1/models", headers={"host": host, "authorization": f"Bearer {KEY}"})
    assert check_error(r, 400)["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1", "LOCALHOST", "[::1]:8000", "[::1]",
                                  "api.internal.test", "a.b.internal.test:443"])
def test_allowed_host_headers_pass(guarded, host):
    server, _ = guarded
    assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200
