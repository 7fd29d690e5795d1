"""Issue 25: bounded fuzzing of the HTTP API against a real uvicorn server on loopback. Request bodies
are built from the fields the OpenAPI routes take, with values of every JSON kind (huge and negative
numbers, NaN and infinities, lone surrogates, deep nesting, wrong types) and random extras; whatever
comes in, the answer is never a 5xx, every error has the OpenAI shape, and the server keeps serving.
Derandomized, so a failure reproduces."""

from __future__ import annotations

import json
import os

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from clover.engine import Engine, EngineOptions  # noqa: E402
from clover.server.app import create_app  # noqa: E402
from test_server import MODEL, TIMEOUT, Server, model, model_dir, tokenizer  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

TEXT = st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=20)
# clover flushes denormals process-wide (runtime.py), so hypothesis cannot make subnormal floats here.
NUMBER = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
                   st.sampled_from([0, 1, -1, 0.5, 1e-45, 1e-40, 2e-38, 1e308, 2 ** 64, 65536, 1024]))
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
JSON_VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
SMALL_INT = st.one_of(st.integers(-3, 40), NUMBER)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer",
                                                                    "tool"]), JSON_VALUE),
                                 "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": TEXT}), max_size=2), JSON_VALUE)})

COMMON = {
    "model": st.one_of(st.just(MODEL), JSON_VALUE), "max_tokens": SMALL_INT, "temperature": NUMBER, "top_p": NUMBER,
    "seed": NUMBER, "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), JSON_VALUE), "n": SMALL_INT,
    "stream": st.one_of(st.booleans(), JSON_VALUE), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUE),
    "frequency_penalty": NUMBER, "presence_penalty": NUMBER, "logit_bias": JSON_VALUE,
    "block_size": SMALL_INT, "threshold": NUMBER, "decoding": st.one_of(
        st.sampled_from(["low_confidence", "self_speculative"]), JSON_VALUE), "draft_steps": SMALL_INT,
    "do_sample": st.one_of(st.booleans(), JSON_VALUE), "top_k": SMALL_INT, "block_expert_top_p": NUMBER,
    "dllm_repetition_penalty": NUMBER, "dllm_repetition_window": SMALL_INT, "dllm_length_penalty_start": SMALL_INT,
    "dllm_length_penalty_window": SMALL_INT, "dllm_length_penalty_strength": NUMBER,
    "dllm_think_end_start": SMALL_INT, "dllm_think_end_window": SMALL_INT, "dllm_think_end_strength": NUMBER,
    "ignore_eos": st.one_of(st.booleans(), JSON_VALUE), "skip_special_tokens": st.one_of(st.booleans(), JSON_VALUE),
    "user": JSON_VALUE, "metadata": JSON_VALUE,
}
CHAT = dict(COMMON, messages=st.one_of(st.lists(MESSAGE, max_size=3), JSON_VALUE),
            max_completion_tokens=SMALL_INT, logprobs=JSON_VALUE, top_logprobs=JSON_VALUE, tools=JSON_VALUE,
            tool_choice=JSON_VALUE, response_format=JSON_VALUE, enable_thinking=st.one_of(st.booleans(), JSON_VALUE),
            chat_template_kwargs=JSON_VALUE)
COMPLETION = dict(COMMON, prompt=st.one_of(TEXT, st.lists(st.integers(-5, 600), max_size=6), st.lists(TEXT, max_size=2),
                                           JSON_VALUE),
                  echo=JSON_VALUE, suffix=JSON_VALUE, best_of=SMALL_INT)


VALID_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
VALID_COMPLETION = {"model": MODEL, "prompt": "hi"}


@st.composite
def body_of(draw, fields, valid):
    """A valid request with up to three fields replaced or added (so that many get past parsing and
    reach validation or the engine), or, one time in five, fields drawn freely plus a random extra."""
    if draw(st.integers(0, 4)) == 0:
        names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True))
        body = {name: draw(fields[name]) for name in names}
        body.update(draw(st.dictionaries(TEXT, JSON_VALUE, max_size=1)))
        return body
    body = dict(valid)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    return body


REQUEST = st.one_of(st.tuples(st.just("/v1/chat/completions"), body_of(CHAT, VALID_CHAT)),
                    st.tuples(st.just("/v1/completions"), body_of(COMPLETION, VALID_COMPLETION)))


@pytest.fixture(scope="module")
def fuzzed(model, tokenizer):
    engine = Engine(model, EngineOptions(max_batch=8, max_queue=16))
    server = Server(create_app(engine, tokenizer, MODEL))
    yield server, engine
    assert server.stop()


def cap_work(body: dict) -> dict:
    """Keep a valid request cheap: the fuzzing is about input handling, not long generations."""
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16
    if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 16:
        body["max_completion_tokens"] = 16
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 8
    return body


def test_fuzzed_requests_never_get_a_5xx(fuzzed):
    server, engine = fuzzed
    client = httpx.Client(base_url=server.url, timeout=TIMEOUT)
    seen = {}

    @settings(max_examples=int(os.environ.get("CLOVER_FUZZ_EXAMPLES", "250")), deadline=None,
              derandomize=os.environ.get("CLOVER_FUZZ_RANDOM") is None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(REQUEST)
    def check(request):
        path, body = request
        content = json.dumps(cap_work(body), allow_nan=True, ensure_ascii=True).encode()
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, content[:500], r.text[:500])
        if r.headers.get("content-type", "").startswith("application/json") and r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]

    check()
    assert seen.get(200, 0) >= 5 and sum(n for s, n in seen.items() if 400 <= s < 500) >= 50, seen
    assert client.get("/health").status_code == 200
    assert engine.batch_size == 0
