"""Issue 25: `clover serve`'s connection limits (header and body deadlines, a connection cap), log
flood control, option checks and binding the port before the model loads. Real uvicorn servers on
127.0.0.1, raw sockets for the misbehaving clients."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from serve_process import launch

from clover.engine import Engine, EngineOptions
from clover.server import cli as serve_cli
from clover.server.app import create_app
from clover.server.limits import DrainingServer, RepeatFilter, uvicorn_config
from test_server import MODEL, TIMEOUT, Server, check_error, model, model_dir, tokenizer  # noqa: F401
from tiny_models import slow_steps

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

SRC = str(Path(__file__).resolve().parents[1] / "src")


class LimitedServer(Server):
    """uvicorn with `clover serve`'s config (uvicorn_config) in a thread, on a port the OS picked."""

    def __init__(self, app, graceful_timeout=5, draining=True, **limits):
        def make_server():
            config = uvicorn_config(app, log_level="warning", graceful_timeout=graceful_timeout, **limits)
            return DrainingServer(config, app.state.begin_drain) if draining else uvicorn.Server(config)
        super().__init__(app, make_server)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)


@pytest.fixture
def make_server(model, tokenizer):
    made = []

    def make(app_options=None, **limits):
        engine = Engine(model, EngineOptions(max_batch=4, max_queue=4))
        server = LimitedServer(create_app(engine, tokenizer, MODEL, **(app_options or {})), **limits)
        server.engine = engine
        made.append(server)
        return server

    yield make
    for server in made:
        if server.thread.is_alive():
            assert server.stop()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reads until EOF; any bytes are ignored)."""
    sock.settimeout(seconds)
    deadline = time.time() + seconds
    try:
        while time.time() < deadline:
            if sock.recv(4096) == b"":
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True
    return False


# ---- slow clients ----------------------------------------------------------------------------------
def test_slowloris_headers_are_cut_off(make_server):
    server = make_server(header_timeout=1.0)
    slow = server.connect()
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")       # never finishes its headers
    t0 = time.time()
    for _ in range(3):                                                   # trickling does not extend it
        time.sleep(0.3)
        slow.sendall(b"X-a: b\r\n")
    assert closed_within(slow, 3.0)
    assert time.time() - t0 < 3.0
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200    # others are served


def test_an_idle_connection_after_a_response_is_closed_too(make_server):
    server = make_server(header_timeout=1.0, keep_alive_timeout=30)
    c = server.connect()
    c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert b"200 OK" in c.recv(4096)
    c.sendall(b"GET /health HTTP/1.1\r\n")                               # a second request, left hanging
    assert closed_within(c, 3.0)


def test_a_connection_that_sends_its_request_in_time_is_not_cut(make_server):
    server = make_server(header_timeout=1.0)
    c = server.connect()
    c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    time.sleep(0.5)
    c.sendall(b"\r\n")
    assert b"200 OK" in c.recv(4096)


def test_slow_body_is_a_408(make_server):
    server = make_server({"body_timeout": 1.0}, header_timeout=5.0)
    c = server.connect()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\": ")                    # 90 bytes never come
    c.settimeout(5.0)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < response_length(data):
        chunk = c.recv(65536)
        if not chunk:
            break
        data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


def response_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    found = [line.split(":", 1)[1] for line in head.split("\r\n") if line.startswith("content-length:")]
    return int(found[0]) if found else 0


def test_connections_past_the_limit_get_503(make_server):
    server = make_server(header_timeout=30.0, max_connections=3)
    hogs = [server.connect() for _ in range(3)]
    for h in hogs:
        h.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")       # held open, headers unfinished
    time.sleep(0.2)
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 503
    for h in hogs:
        h.close()
    deadline = time.time() + TIMEOUT
    while httpx.get(server.url + "/health", timeout=TIMEOUT).status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)


# ---- shutdown past the grace period ------------------------------------------------------------------
@pytest.fixture
def very_slow_forwards(model, monkeypatch):
    """Every forward takes >= 20 ms: a 400-token request runs for 8 s or more."""
    slow_steps(monkeypatch, model, 0.02)


def test_requests_running_past_the_grace_period_end_with_an_error_event(make_server, very_slow_forwards):
    server = make_server({"shutdown_timeout": 2.0}, graceful_timeout=2.0)
    body = {"model": MODEL, "prompt": "Long", "max_tokens": 400, "block_size": 1, "ignore_eos": True}
    lines, first, results = [], threading.Event(), {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first.set()

    def whole():
        results["whole"] = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)

    readers = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in readers:
        t.start()
    assert first.wait(TIMEOUT)
    time.sleep(0.3)                                  # the non-streaming one is surely running too
    t0 = time.time()
    assert server.stop()
    for t in readers:
        t.join(TIMEOUT)
    assert time.time() - t0 < 2.0 + 3.0              # the grace period plus a little
    assert lines[-1] == "[DONE]", lines[-3:]
    assert json.loads(lines[-2])["error"]["code"] == "shutting_down"
    err = check_error(results["whole"], 503)
    assert err["code"] == "shutting_down"


# ---- log flood control ------------------------------------------------------------------------------
def test_repeat_filter_limits_identical_lines():
    now = [0.0]
    filt = RepeatFilter(burst=3, interval=10.0, clock=lambda: now[0])
    record = lambda msg, *args: logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, args, None)  # noqa: E731
    passed = [filt.filter(record("accept failed: %s", i)) for i in range(1000)]
    assert sum(passed) == 3 and passed[:3] == [True] * 3
    assert filt.filter(record("another message"))                       # other lines are untouched
    now[0] = 10.5
    again = record("accept failed: %s", 1000)
    assert filt.filter(again) and "997 identical messages suppressed" in again.getMessage()


def test_repeat_filter_is_installed_on_error_logs_not_on_the_access_log(model, tokenizer):
    from clover.server.limits import install_repeat_filter

    engine = Engine(model, EngineOptions(), start=False)
    uvicorn_config(create_app(engine, tokenizer, MODEL), log_level="info")      # configures uvicorn's loggers
    logging.basicConfig()
    filt = install_repeat_filter()
    try:
        error_handlers = logging.getLogger("uvicorn").handlers + logging.getLogger().handlers
        assert error_handlers and all(filt in h.filters for h in error_handlers)
        assert all(filt not in h.filters for h in logging.getLogger("uvicorn.access").handlers)
    finally:
        for h in logging.getLogger("uvicorn").handlers + logging.getLogger().handlers:
            h.removeFilter(filt)


# ---- clover serve: options, the port first ----------------------------------------------------------
def serve_args(*argv):
    return serve_cli.add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], "--port must lie in 0..65535, got 99999"),
    (["--port", "-1"], "--port must lie in 0..65535"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--max-sequences", "0"], "--max-sequences must be at least 1"),
    (["--stream-buffer-tokens", "0"], "--stream-buffer-tokens must be at least 1"),
    (["--stream-idle-timeout", "0"], "--stream-idle-timeout must be > 0"),
    (["--header-timeout", "0"], "--header-timeout must be > 0"),
    (["--model", "/nonexistent/dir"], "no model at /nonexistent/dir"),
])
def test_bad_options_are_one_line(argv, words, capsys):
    assert serve_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("clover serve: error: ") and words in err, err


def test_busy_port_is_reported_before_the_model_loads(monkeypatch, capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    loads = []
    monkeypatch.setattr(serve_cli, "build", lambda args: loads.append(args))
    try:
        assert serve_cli.main(["--port", str(busy.getsockname()[1])]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert loads == [] and err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err, err


def test_the_serving_line_is_logged_once_connections_are_accepted(monkeypatch):
    """Clients (tests, lm-eval's fixture) connect as soon as they read "serving … on http://…": at
    that moment the port must accept, not refuse while uvicorn is still starting."""
    from types import SimpleNamespace

    from clover.server import limits

    connected = []

    class ConnectOnServingLine(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("serving "):
                port = int(record.getMessage().split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    connected.append(True)
                except ConnectionRefusedError:
                    connected.append(False)

    class NotServing:                         # stands in for uvicorn: the test is about what precedes it
        def __init__(self, config, begin_drain):
            pass

        def run(self, sockets):
            pass

    app = SimpleNamespace(state=SimpleNamespace(api_key=None, begin_drain=lambda: None))
    monkeypatch.setattr(serve_cli, "build", lambda args: (app, SimpleNamespace(shutdown=lambda graceful: None)))
    monkeypatch.setattr(limits, "DrainingServer", NotServing)
    handler = ConnectOnServingLine()
    logger = logging.getLogger("clover.server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)             # pytest's own root handler keeps basicConfig from setting it
    try:
        assert serve_cli.main(["--port", "0", "--log-level", "info"]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert connected == [True]


def test_clover_serve_port_99999_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "clover.cli", "serve", "--port", "99999"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "clover serve: error: --port must lie in 0..65535, got 99999"


def test_clover_serve_end_to_end_with_api_key_from_the_environment(model_dir):
    """The real command: CLOVER_API_KEY guards /v1 and /metrics, /health stays open, and the served
    name is the model directory's name (or --served-model-name)."""
    proc, url, port = launch(["--model", str(model_dir), "--served-model-name", "my-model", "--log-level", "info",
                              "--threads", "1"], env={"CLOVER_API_KEY": "k-123"}, command=("-m", "clover.server"))
    try:
        check_error(httpx.get(url + "/v1/models"), 401)
        banner = proc.stdout.readline()                       # the first line: where to connect
        assert f"serving 'my-model' on http://127.0.0.1:{port}/v1 (API key required)" in banner, banner
        check_error(httpx.get(url + "/metrics", headers={"authorization": "Bearer nope"}), 401)
        r = httpx.get(url + "/v1/models", headers={"authorization": "Bearer k-123"})
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["my-model"]
    finally:
        proc.terminate()
        proc.wait(60)
