"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 with a tiny random model
and a real tokenizer, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn

import clover
from clover.checkpoint import save_checkpoint
from clover.engine import Engine, EngineOptions
from clover.server.app import create_app
from clover.server.text import StopMatcher, TextStream
from clover.tokenization import CloverTokenizer
from clover.training.build_tokenizer import build_tokenizer
from tiny_models import slow_steps, make_model

MODEL = "tiny"
TIMEOUT = 60


# ---- fixtures --------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_server_model")
    build_tokenizer(str(path))
    m = make_model(vocab_size=512, mask_token_id=5, think_token_id=3, think_end_token_id=4, eos_token_id=[2, 0],
                   max_position_embeddings=512)
    save_checkpoint(m, m.config, path)
    (path / "generation_config.json").write_text(json.dumps({"block_size": 4, "threshold": 0.9, "max_new_tokens": 24}))
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return clover.load(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return CloverTokenizer.from_dir(model_dir)


class Server:
    """uvicorn in a background thread, on a port the OS picked (`make_server`: builds another uvicorn
    server or config instead of the default one)."""

    def __init__(self, app, make_server=None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if make_server is None:
            self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=20,
                                                        lifespan="on"))
        else:
            self.server = make_server()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def stop(self, timeout=30) -> bool:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        return not self.thread.is_alive()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


@contextlib.contextmanager
def demo_client(model_name: str, **options):
    """The bundled demo model served in-process (one thread, `EngineOptions(**options)`), as an openai client."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(clover.load(), EngineOptions(**options))
    srv = Server(create_app(engine, CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR), model_name))
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        assert srv.stop()
        torch.set_num_threads(threads)


def start(model, tokenizer, **options) -> tuple[Server, Engine]:
    engine = Engine(model, EngineOptions(**options))
    return Server(create_app(engine, tokenizer, MODEL, max_body_bytes=64 * 1024)), engine


@pytest.fixture(scope="module")
def served(model, tokenizer):
    server, engine = start(model, tokenizer, max_batch=16, max_queue=32)
    yield server, engine
    assert server.stop()


@pytest.fixture(scope="module")
def client(served):
    return served[0].client()


def chat_text(client, content, stream=False, **kw):
    """(reasoning, content, finish_reason, completion_tokens) of one chat request."""
    extra = kw.pop("extra_body", {})
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                           extra_body=extra, **kw)
        m = r.choices[0].message
        return (m.model_extra or {}).get("reasoning_content") or "", m.content, r.choices[0].finish_reason, \
            r.usage.completion_tokens
    reasoning, text, finish, usage, chunks = "", "", None, None, 0
    for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=extra, **kw):
        if c.usage is not None:
            usage = c.usage.completion_tokens
        if not c.choices:
            continue
        d = c.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        text += d.content or ""
        finish = c.choices[0].finish_reason or finish
        chunks += 1
    return reasoning, text, finish, usage


def completion_text(client, prompt, stream=False, **kw):
    extra = kw.pop("extra_body", {})
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    for c in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra, **kw):
        if c.usage is not None:
            usage = c.usage.completion_tokens
        if c.choices:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
    return text, finish, usage


# ---- the OpenAI client ---------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_streamed_equals_non_streamed(client, thinking):
    kw = dict(max_tokens=24, extra_body={"enable_thinking": thinking, "block_size": 4})
    whole = chat_text(client, "What is 12 + 30?", **kw)
    streamed = chat_text(client, "What is 12 + 30?", stream=True, **kw)
    assert streamed == whole
    reasoning, content, finish, n = whole
    assert finish in ("stop", "length") and 1 <= n <= 24
    if not thinking:
        assert reasoning == ""            # the prompt closed the thinking span: all text is content
    assert reasoning or content


def test_completion_streamed_equals_non_streamed(client):
    kw = dict(max_tokens=20, temperature=0, extra_body={"block_size": 2, "threshold": 0.8})
    whole = completion_text(client, "The answer is", **kw)
    assert completion_text(client, "The answer is", stream=True, **kw) == whole
    assert whole[1] in ("stop", "length") and whole[0]


def test_stream_sends_a_chunk_per_block(served):
    server, _ = served
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "block_size": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    n = sum(1 for c in chunks if c["choices"][0]["text"])
    assert n >= 2          # text arrives block by block, not at the end


def test_sixteen_concurrent_requests_match_alone(served):
    server, engine = served
    client = server.client()
    jobs = []
    for i in range(16):
        extra = {"block_size": [1, 2, 4, 8][i % 4], "threshold": [0.5, 0.9, 1.0, 0.7][i // 4],
                 "decoding": "self_speculative" if i % 5 == 1 else "low_confidence",
                 "dllm_repetition_penalty": 1.0 + 0.1 * (i % 3)}
        if i % 2:
            jobs.append(("chat", f"Question {i}: what is {i} times {i + 3}?",
                         dict(max_tokens=8 + 2 * i, extra_body=dict(extra, enable_thinking=i % 4 == 1))))
        else:
            jobs.append(("completion", f"Story {i}: once upon a time" + " again" * i,
                         dict(max_tokens=8 + 2 * i, temperature=0, extra_body=extra)))

    def run(job):
        kind, prompt, kw = job
        kw = dict(kw, extra_body=dict(kw["extra_body"]))
        return chat_text(client, prompt, **kw) if kind == "chat" else completion_text(client, prompt, **kw)

    alone = [run(j) for j in jobs]
    steps_before = engine.metrics.value("clover_engine_steps_total")
    batch_before = engine.metrics.value("clover_step_batch_size_sum")
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs))
    assert together == alone
    steps = engine.metrics.value("clover_engine_steps_total") - steps_before
    batched = engine.metrics.value("clover_step_batch_size_sum") - batch_before
    assert batched / steps > 2                                          # they really shared forwards


def test_sampling_fields_behave(client):
    a = completion_text(client, "Seeded", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    b = completion_text(client, "Seeded", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    assert a == b                                  # same seed, same sample
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"block_size": 2,
                                                                                   "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stop_strings_truncate(client):
    kw = dict(max_tokens=40, extra_body={"block_size": 1, "ignore_eos": True})
    for prompt in ("Stop test one", "Stop test two", "Stop test three", "Another"):
        text, _, _ = completion_text(client, prompt, **kw)
        if len(text) >= 12:
            break
    assert len(text) >= 12, "the random model ended every prompt too early"
    stop = text[6:9]
    expected = text[: text.find(stop)]
    whole, streamed = (completion_text(client, prompt, stream=s, stop=[stop, "never-there"], **kw)
                       for s in (False, True))
    assert whole == streamed and whole[:2] == (expected, "stop") and whole[2] < 40


def test_models_health_metrics(served):
    server, _ = served
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("clover_requests_total", "clover_prompt_tokens_total", "clover_generation_tokens_total",
                 "clover_tokens_per_forward", "clover_queue_depth", "clover_batch_size",
                 "clover_request_latency_seconds_bucket", "clover_time_to_first_token_seconds_bucket",
                 'clover_http_requests_total{route="/v1/completions",status="200"}'):
        assert name in r.text, name


# ---- bad input -----------------------------------------------------------------------------------
def post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=TIMEOUT)


def check_error(r, status, param_or_none=..., words=()):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param_or_none is not ...:
        assert err["param"] == param_or_none, err
    for w in words:
        assert w in err["message"], err
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("change, param, words", [
    ({"max_tokens": "ten"}, "max_tokens", ["integer"]),
    ({"max_tokens": 4.5}, "max_tokens", ["integer"]),
    ({"temperature": "hot"}, "temperature", ["number"]),
    ({"messages": "hello"}, "messages", ["list"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", []),
    ({"messages": []}, "messages", ["empty"]),
    ({"stream": "yes"}, "stream", ["bool"]),
    ({"max_tokens": -5}, "max_tokens", ["at least 1"]),
    ({"max_tokens": 0}, "max_tokens", ["at least 1"]),
    ({"max_completion_tokens": -1}, "max_completion_tokens", ["at least 1"]),
    ({"max_tokens": 10 ** 9}, "messages", ["exceeds the 512-token context"]),
    ({"temperature": 3.5}, "temperature", ["[0, 2]"]),
    ({"top_p": 0}, "top_p", ["(0, 1]"]),
    ({"threshold": 1.5}, "threshold", ["threshold must lie in (0, 1]"]),
    ({"threshold": 0}, "threshold", ["threshold"]),
    ({"block_size": 0}, "block_size", ["block_size must be >= 1"]),
    ({"decoding": "magic"}, "decoding", ["decoding must be one of"]),
    ({"dllm_repetition_penalty": -1}, "dllm_repetition_penalty", []),
    ({"treshold": 0.5}, "treshold", ["unknown field"]),
    ({"n": 2}, "n", ["n must be 1"]),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", ["at most 4"]),
    ({"enable_thinking": "maybe"}, "enable_thinking", []),
])
def test_bad_chat_fields(served, change, param, words):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    err = check_error(post(server, "/v1/chat/completions", dict(CHAT, **change)), 400, param, words)
    assert err["type"] == "invalid_request_error"
    assert engine.metrics.value("clover_engine_steps_total") == steps          # nothing reached the engine


def test_bad_requests_and_the_server_keeps_serving(served, tokenizer):
    server, engine = served
    client = server.client()
    check_error(post(server, "/v1/chat/completions", dict(CHAT, model="gpt-5")), 404, "model", ["gpt-5"])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError, match="threshold"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], extra_body={"threshold": 2})
    check_error(post(server, "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                     headers={"content-type": "application/json"}), 400, None, ["not valid JSON"])
    check_error(post(server, "/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}),
                400, None, ["JSON"])
    check_error(post(server, "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                400, None, ["object"])
    big = dict(CHAT, messages=[{"role": "user", "content": "x" * 100_000}])
    check_error(post(server, "/v1/chat/completions", big), 413, None, ["limit"])
    # The same size sent chunked (no Content-Length) is cut off while reading.
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}'
    check_error(post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    long_prompt = " ".join(str(i % 10) for i in range(600))
    err = check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 4}), 400,
                      "prompt", ["exceeds the 512-token context"])
    assert err["code"] == "context_length_exceeded"
    # too long by its length alone: refused before templating or tokenizing, naming the bound
    longest = tokenizer.max_token_bytes
    err = check_error(post(server, "/v1/chat/completions", dict(CHAT, messages=[
        {"role": "user", "content": "z" * (longest * 513)}])), 400, "messages", ["at least 513 tokens", "512-token"])
    assert err["code"] == "context_length_exceeded"
    check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}), 400, "prompt", ["vocab"])
    check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": ""}), 400, "prompt", ["empty"])
    check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt")
    check_error(post(server, "/v1/completions", {"prompt": "x"}), 400, "model", ["required"])
    check_error(httpx.get(server.url + "/v1/nothing"), 404)
    check_error(httpx.get(server.url + "/v1/chat/completions"), 405)
    # Still serving, and nothing is left running.
    assert completion_text(client, "still alive", max_tokens=4)[1] in ("stop", "length")
    assert httpx.get(server.url + "/health").status_code == 200
    assert engine.batch_size == 0 and engine.queue_depth == 0


# ---- disconnects, full queues, shutdown ----------------------------------------------------------------
def wait_for(predicate, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def slow_forwards(model, monkeypatch):
    """Every forward takes ≥ 5 ms, so a long request is surely still running when the test acts."""
    slow_steps(monkeypatch, model, 0.005)


def test_disconnect_mid_stream_frees_the_slot(served, slow_forwards):
    server, engine = served
    client = server.client()
    kw = dict(max_tokens=24, extra_body={"block_size": 2})
    expected = completion_text(client, "Bystander", **kw)
    cancelled = engine.metrics.value("clover_requests_total", finish_reason="cancelled")
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(completion_text, client, "Bystander", **kw)
        body = {"model": MODEL, "prompt": "Leaver", "max_tokens": 400, "block_size": 1, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break               # leave after the first text
        assert bystander.result(TIMEOUT) == expected
    wait_for(lambda: engine.metrics.value("clover_requests_total", finish_reason="cancelled") == cancelled + 1)
    wait_for(lambda: engine.batch_size == 0)


def test_non_streaming_client_that_leaves_is_cancelled(served, slow_forwards):
    server, engine = served
    cancelled = engine.metrics.value("clover_requests_total", finish_reason="cancelled")
    body = {"model": MODEL, "prompt": "Impatient", "max_tokens": 400, "block_size": 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: engine.metrics.value("clover_requests_total", finish_reason="cancelled") == cancelled + 1)
    wait_for(lambda: engine.batch_size == 0)


def test_a_failing_forward_is_an_error_response_and_the_server_recovers(served, model, monkeypatch):
    server, engine = served

    def broken(self, *args, **kwargs):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(type(model.runner), "step", broken)
    err = check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4}), 500)
    assert err["type"] == "server_error" and "simulated device fault" in err["message"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "simulated device fault" in json.loads(data[-2])["error"]["message"]
    monkeypatch.undo()
    assert completion_text(server.client(), "recovered", max_tokens=4)[1] in ("stop", "length")


def test_default_max_tokens_fits_the_context(client):
    r = client.completions.create(model=MODEL, prompt=[10] * 500, extra_body={"block_size": 4, "ignore_eos": True})
    assert r.usage.completion_tokens == 12           # (512 - 500) // 4 * 4, below the default 24
    assert r.choices[0].finish_reason == "length"


def test_cli_arguments_build_a_server(model_dir):
    import argparse

    from clover.server import add_serve_arguments
    from clover.server.cli import build

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", str(model_dir), "--port", "0", "--max-batch", "3", "--max-queue", "5", "--max-cache-gb", "0.5",
         "--max-sequences", "7"])
    assert (args.host, args.port) == ("127.0.0.1", 0)
    app, engine = build(args)
    try:
        assert engine.options.max_batch == 3 and engine.options.max_queue == 5 and engine.max_sequences == 7
        assert engine.options.max_cache_bytes == 1 << 29
        assert app.state.model_name == model_dir.name
    finally:
        engine.shutdown()


def test_full_queue_gets_429_and_recovers(model, tokenizer, slow_forwards):
    server, engine = start(model, tokenizer, max_batch=1, max_sequences=1, max_queue=0)
    try:
        client = server.client()
        body = {"model": MODEL, "prompt": "Hog", "max_tokens": 400, "block_size": 1, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()     # kept referenced: a collected iterator closes the connection
            for line in lines:
                if line.startswith("data: "):
                    break
            err = check_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}), 429)
            assert err["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
        wait_for(lambda: engine.batch_size == 0)
        assert completion_text(client, "after", max_tokens=4)[1] in ("stop", "length")
        assert 'clover_requests_rejected_total{reason="queue_full"} 2' in httpx.get(server.url + "/metrics").text
    finally:
        assert server.stop()


def test_graceful_shutdown_finishes_open_streams(model, tokenizer):
    server, engine = start(model, tokenizer, max_batch=4, max_queue=4)
    lines, first = [], threading.Event()

    def reader():
        body = {"model": MODEL, "prompt": "Finish me", "max_tokens": 60, "block_size": 1, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first.set()

    t = threading.Thread(target=reader)
    t.start()
    assert first.wait(TIMEOUT)
    assert server.stop(timeout=TIMEOUT)          # returns: nothing hangs
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length")
    assert not engine.accepting


# ---- text: thinking split and stop strings -------------------------------------------------------------
def test_text_stream_splits_thinking(tokenizer):
    ids = tokenizer.encode("Let me think.\n</think>\n\nThe answer is 42.<|im_end|>")
    for chunking in (1, 3, len(ids)):
        ts = TextStream(tokenizer, split_thinking=True, inside_thinking=True, eos_ids=tokenizer.eos_token_ids)
        parts = [ts.feed(ids[i:i + chunking]) for i in range(0, len(ids), chunking)] + [ts.flush()]
        reasoning = "".join(p["reasoning"] for p in parts)
        content = "".join(p["content"] for p in parts)
        assert (reasoning, content) == ("Let me think.", "The answer is 42.")
    ts = TextStream(tokenizer, split_thinking=True, inside_thinking=False, eos_ids=tokenizer.eos_token_ids)
    out = ts.feed(tokenizer.encode("Plain answer.<|im_end|>"))
    assert out["content"] + ts.flush()["content"] == "Plain answer." and out["reasoning"] == ""


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["STOP", "xy"])
    assert m.feed("abcST") == "abc"
    assert m.feed("O") == ""
    assert m.feed("P and more") == "" and m.stopped
    assert m.flush() == ""
    m = StopMatcher(["STOP"])
    assert m.feed("aST") + m.feed("Ob") + m.flush() == "aSTOb"


def test_a_pool_budget_too_small_is_a_clear_error(model_dir):
    """`--max-cache-gb` below what the batch's GDN states need: `clover serve` names the sizes and exits
    2, before anything listens (no traceback)."""
    import argparse

    from clover.server import add_serve_arguments
    from clover.server.cli import ServeError, build

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", str(model_dir), "--port", "0", "--max-cache-gb", "0.000001"])
    with pytest.raises(ServeError, match="state-pool budget of 1073 bytes is too small"):
        build(args)
