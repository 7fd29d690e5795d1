"""The body worker process (server/bodies.py): large bodies are prepared there with the very answers
the server gives in-process (prompts.py), and a worker that dies fails only the request it was on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

import clover
from clover.server.bodies import BodyWorker
from clover.server.prompts import PREPARE, ServedModel
from clover.server.protocol import APIError
from clover.tokenization import CloverTokenizer

MODEL = "clover-demo"


@pytest.fixture(scope="module")
def tokenizer():
    return CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def served(tokenizer):
    return ServedModel(MODEL, 512, tokenizer.max_token_bytes)


@pytest.fixture(scope="module")
def worker(tokenizer, served):
    w = BodyWorker(tokenizer, served)
    yield w
    w.close()


def chat(content, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}).encode()


def completion(prompt, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, **extra}).encode()


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
BODIES = [
    ("chat", chat("What is 17+25?", max_tokens=8, stop=["\n"], enable_thinking=False)),
    ("chat", chat("Add them", tools=[TOOL], tool_choice="required", logprobs=True, top_logprobs=2)),
    ("chat", chat("hi <|im_start|>system", skip_special_tokens=False, stream=True, step_events=True)),
    ("chat", chat("z" * 20_000)),                                   # too long by its length alone
    ("chat", chat("hi", tools=[{"type": "nope"}])),
    ("chat", chat("hi", chat_template_kwargs={"messages": 1})),
    ("chat", chat("hi", logprobs=True, stream=True)),
    ("chat", chat("hi", dllm_nonsense=1)),
    ("chat", json.dumps({"model": MODEL, "messages": []}).encode()),
    ("chat", json.dumps({"model": "other", "messages": [{"role": "user", "content": "hi"}]}).encode()),
    ("chat", b'{"model": "clover-demo", "messages": ['),                  # not JSON
    ("chat", b"[" * 100_000 + b"]" * 100_000),                             # too deep
    ("chat", b'{"model": "clover-demo", "messages": [{"role": "user", "content": "a\\ud800"}]}'),
    ("completion", completion("17+25=", max_tokens=4, echo=True, logprobs=1)),
    ("completion", completion([1, 2, 3, 2 ** 70])),                       # kept whole (the engine refuses it)
    ("completion", completion([[4, 5, 6]])),
    ("completion", completion("")),
    ("completion", completion(["a", "b"])),
    ("completion", completion("x", enable_thinking=True)),
    ("completion", b"[1, 2]"),
]


def outcome(call):
    """What a preparation gives, comparable across processes: its fields, or its error."""
    try:
        prompt = call()
    except APIError as exc:
        return ("error", exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)
    fields = dict(vars(prompt))
    req = fields.pop("req").model_dump()
    req.pop("messages", None)
    req.pop("prompt", None)                   # (the worker drops the prompt text: the ids stand for it)
    return ("prompt", req, {k: v if k != "ids" else list(v) for k, v in fields.items()})


@pytest.mark.parametrize("kind, body", BODIES, ids=range(len(BODIES)))
def test_the_worker_answers_as_the_server_does(worker, tokenizer, served, kind, body):
    here = outcome(lambda: PREPARE[kind](body, tokenizer, served))
    there = outcome(lambda: asyncio.run(worker.prepare(kind, body)))
    assert there == here


def test_a_long_prompt_comes_back_packed_and_a_fitting_one_as_a_list(worker):
    long = asyncio.run(worker.prepare("completion", completion(list(range(600)))))
    assert len(long.ids) == 600 and not isinstance(long.ids, list)      # refused from its length: never unpacked
    short = asyncio.run(worker.prepare("completion", completion(list(range(500)))))
    assert short.ids == list(range(500))


def test_a_bug_in_the_worker_is_raised_here_with_its_traceback(worker, monkeypatch):
    async def broken():
        return await worker.prepare("nonsense", b"{}")       # no such kind: a KeyError in the worker
    with pytest.raises(KeyError) as info:
        asyncio.run(broken())
    assert "nonsense" in str(info.value) and "Traceback" in str(info.value.__cause__)


def state(pid: int) -> str:
    """A process's state letter (R: running or runnable, S: asleep, e.g. waiting for a body)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_worker_that_dies_fails_its_request_and_the_next_gets_a_new_one(tokenizer, served):
    served = ServedModel(MODEL, 1 << 20, tokenizer.max_token_bytes)       # (room to tokenize a long prompt)
    worker = BodyWorker(tokenizer, served)
    try:
        asyncio.run(worker.prepare("chat", chat("warm up")))
        first = worker.pid
        words = "seventeen plus twenty five is forty two "

        async def killed_midway():
            job = asyncio.ensure_future(worker.prepare("completion", completion(words * 25_000)))   # ~1 MB
            deadline = time.time() + 30
            while state(first) != "R":                   # at work on it (tokenizing takes ~0.5 s)
                assert time.time() < deadline
                await asyncio.sleep(0.001)
            os.kill(first, signal.SIGKILL)
            return await job

        with pytest.raises(APIError) as info:
            asyncio.run(killed_midway())
        err = info.value
        assert (err.status, err.code) == (500, "worker_failed")
        assert "killed by SIGKILL while preparing this one" in err.message
        assert outcome(lambda: asyncio.run(worker.prepare("chat", chat("again")))) == \
            outcome(lambda: PREPARE["chat"](chat("again"), tokenizer, served))
        assert worker.pid not in (None, first)
        # One that died between requests is replaced without failing anyone.
        os.kill(worker.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert asyncio.run(worker.prepare("chat", chat("and again"))).ids
    finally:
        worker.close()


def test_close_ends_the_process_and_refuses_what_comes_after(tokenizer, served):
    worker = BodyWorker(tokenizer, served)
    asyncio.run(worker.prepare("chat", chat("hi")))
    pid = worker.pid
    worker.close()
    assert worker.pid is None and not os.path.exists(f"/proc/{pid}")
    with pytest.raises(APIError) as info:
        asyncio.run(worker.prepare("chat", chat("hi")))
    assert (info.value.status, info.value.code) == (503, "shutting_down")
