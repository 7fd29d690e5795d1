"""Structured output over loopback with the official `openai` client, on the demo model: every
constrained answer must parse and validate (`jsonschema`, independent of the grammar library) against
its schema, with thinking on (the demo default) and off, LowConfidence and autoregressive, and end
within max_tokens. Bad schemas are 400s. Strict tool arguments validate against the tool's schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

import clover
from clover.engine import Engine, EngineOptions
from clover.server.app import create_app
from clover.tokenization import CloverTokenizer
from clover.training.tool_tasks import DEMO_TOOLS
from json_schemas import generated_schemas
from test_server import Server

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "clover-demo"
ASK = [{"role": "user", "content": "Describe the answer as JSON."}]


def _serving(**load):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(clover.load(clover.DEMO_MODEL_DIR, **load), EngineOptions(max_batch=4, max_queue=8))
    srv = Server(create_app(engine, CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR), MODEL))
    yield srv
    assert srv.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    yield from _serving()


@pytest.fixture(scope="module")
def reference_client():
    """The demo model on the fp32 reference, where self-speculative output is autoregressive output bit
    for bit (on the bf16 fast path their GDN roundings differ: verification runs PyTorch's, which keeps
    rollback records, where a decode token runs the kernel's)."""
    for srv in _serving(dtype=torch.float32):
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def json_schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---- 20 generated schemas of varied shape (tests/json_schemas.py) -----------------------------------
def answer_of(r) -> str:
    return r.choices[0].message.content


@pytest.mark.parametrize("k", range(20))
def test_json_schema_outputs_validate(client, k):
    schema = generated_schemas()[k]
    thinking = k % 2 == 0                        # half think first (the demo default), half do not
    block = 1 if k % 7 == 3 else 32              # a few autoregressive
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=160, response_format=json_schema_format(schema),
        extra_body={"enable_thinking": thinking, "block_size": block})
    assert r.choices[0].finish_reason == "stop", (schema, r)
    assert r.usage.completion_tokens <= 160
    jsonschema.validate(json.loads(answer_of(r)), schema)
    if thinking:
        assert r.choices[0].message.model_extra.get("reasoning_content") is not None


@pytest.mark.parametrize("k", range(0, 20, 2))
def test_self_speculative_json_schema_equals_autoregressive(reference_client, k):
    """Self-speculative decoding verifies its drafts under the grammar: the answers validate, and
    (greedy, lossless) they are the autoregressive answers."""
    schema = generated_schemas()[k]
    thinking = k % 4 == 0
    answers = []
    for extra in ({"block_size": 1}, {"decoding": "self_speculative", "block_size": 32}):
        r = reference_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=160, response_format=json_schema_format(schema),
            extra_body={"enable_thinking": thinking, **extra})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 160
        jsonschema.validate(json.loads(answer_of(r)), schema)
        answers.append((answer_of(r), r.choices[0].message.model_extra.get("reasoning_content")))
    assert answers[1] == answers[0]


def test_json_object(client):
    for thinking in (True, False):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96,
                                           response_format={"type": "json_object"},
                                           extra_body={"enable_thinking": thinking})
        assert isinstance(json.loads(answer_of(r)), dict) and r.choices[0].finish_reason == "stop"


def test_streamed_equals_whole(client):
    schema = generated_schemas()[0]
    kw = dict(model=MODEL, messages=ASK, max_tokens=128, response_format=json_schema_format(schema), temperature=0)
    whole = answer_of(client.chat.completions.create(**kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), schema)


def test_small_budget_still_ends_with_a_valid_answer(client):
    """The thinking is cut and the answer closed so that both fit in max_tokens."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    # 15: the closing walk's path to `</think>\n\n{"name":"","n":0}` and the end (the BPE writes it in 14)
    for max_tokens in (15, 21, 32):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=max_tokens,
                                           response_format=json_schema_format(schema))
        assert r.usage.completion_tokens <= max_tokens and r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer_of(r)), schema)
    with pytest.raises(openai.BadRequestError, match="shortest valid answer found takes 15 tokens"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=14, response_format=json_schema_format(schema))


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "strng"}, "Invalid type"),
    ({"type": "object", "properties": "x"}, "properties must be an object"),
    ({"$ref": "#/definitions/nope"}, "does not exist"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"not": {"type": "string"}}, "not"),
    ("not a schema", "schema object"),
])
def test_bad_schemas_are_400(server, schema, fragment):
    body = {"model": MODEL, "messages": ASK, "response_format": json_schema_format(schema)}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"].startswith("response_format")


@pytest.mark.parametrize("response_format, extra, param", [
    ({"type": "xml"}, {}, "response_format.type"),
    ({"type": "json_schema"}, {}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, {}, "response_format.json_schema.name"),
    ({"type": "json_object"}, {"ignore_eos": True}, "ignore_eos"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 400}}, "required": ["a"]}}},
     {"max_tokens": 32}, "max_tokens"),
])
def test_bad_structured_requests_are_400(server, response_format, extra, param):
    body = {"model": MODEL, "messages": ASK, "response_format": response_format, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- strict tool arguments -----------------------------------------------------------------------
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert a quantity between units", "strict": True,
    "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "unit": {"type": "string", "enum": ["km", "mi", "kg", "lb"]},
        "to": {"type": "string", "enum": ["km", "mi", "kg", "lb"]}, "precise": {"type": "boolean"},
        "note": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["value", "unit", "to", "precise"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up", "strict": True,
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["key"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "convert"}},
                                    {"type": "function", "function": {"name": "lookup"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_strict_tool_arguments_validate(client, choice, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Convert 5 km to miles."}], tools=[CONVERT, LOOKUP],
              tool_choice=choice, max_tokens=256)
    if stream:
        with _stream(client, kw) as (finish, calls):
            pass
    else:
        r = client.chat.completions.create(**kw)
        finish, calls = r.choices[0].finish_reason, r.choices[0].message.tool_calls
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0].function
    schema = {"convert": CONVERT, "lookup": LOOKUP}[call.name]["function"]["parameters"]
    if isinstance(choice, dict):
        assert call.name == choice["function"]["name"]
    jsonschema.validate(json.loads(call.arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "convert"}}])
def test_strict_tool_arguments_self_speculative(client, choice):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Convert 5 km to miles."}], tools=[CONVERT, LOOKUP],
              tool_choice=choice, max_tokens=256)
    calls = [client.chat.completions.create(**kw, extra_body=extra).choices[0].message.tool_calls
             for extra in ({"block_size": 1}, {"decoding": "self_speculative"})]
    assert len(calls[1]) == 1
    call = calls[1][0].function
    schema = {"convert": CONVERT, "lookup": LOOKUP}[call.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert (call.name, call.arguments) == (calls[0][0].function.name, calls[0][0].function.arguments)


@pytest.mark.parametrize("thinking", [True, False])
def test_strict_tools_under_auto_leave_text_answers_alone(reference_client, thinking):
    """tool_choice "auto" with strict tools: the grammar allows any text without `<tool_call>`. Offered
    the demo tools it was trained on, the demo model answers an addition in text (it learnt when no
    tool is needed): autoregressive and self-speculative decoding, which take the grammar's choice at
    each causal position, write the same text answer (on the fp32 reference, where the two are equal
    to the bit); LowConfidence ends in text or with calls that follow their schemas. The same tools
    without `strict` render another prompt (the flag is part of the tools' JSON), so the free answer is
    not the comparison here; that text passes the grammar unchanged is tests/test_strict_auto_tools.py's
    `test_valid_output_passes_unchanged`, and a call, once opened, following the schema is there too."""
    ask = [{"role": "user", "content": "What is 17+25?"}]
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in DEMO_TOOLS]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in DEMO_TOOLS}
    answers = []
    for extra in ({"block_size": 1}, {"decoding": "self_speculative"}, {}):
        r = reference_client.chat.completions.create(model=MODEL, messages=ask, tools=strict, max_tokens=128,
                                                     extra_body={"enable_thinking": thinking, **extra})
        choice = r.choices[0]
        if not extra:                            # LowConfidence: text, or calls that follow the schema
            assert choice.finish_reason in ("stop", "tool_calls")
            for call in choice.message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            continue
        assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content
        answers.append((choice.message.content, choice.message.model_extra.get("reasoning_content")))
    assert answers[0] == answers[1]


class _stream:
    """The client's own stream accumulator over a streamed request: (finish_reason, tool_calls)."""

    def __init__(self, client, kw):
        self.client, self.kw = client, kw

    def __enter__(self):
        from openai.lib.streaming.chat import ChatCompletionStreamState
        state = ChatCompletionStreamState()
        for chunk in self.client.chat.completions.create(stream=True, **self.kw):
            state.handle_chunk(chunk)
        done = state.current_completion_snapshot.choices[0]
        return done.finish_reason, done.message.tool_calls

    def __exit__(self, *exc):
        return False


def test_strict_tool_schema_problems_are_400(server):
    both = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": ["string", "integer"]}}}}}
    body = {"model": MODEL, "messages": ASK, "tools": [both], "tool_choice": "required"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    bad = {"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "intger"}}, "required": ["n"]}}}
    body = {"model": MODEL, "messages": ASK, "tools": [bad], "tool_choice": "required"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema", r.text


# ---- the rest of the chat surface, on the real engine ---------------------------------------------
def test_stop_inside_reasoning_counts_returned_tokens(client):
    """Blocks of 32 on the demo model: a stop string early in the thinking ends the response there, and
    usage counts the tokens up to it, not the whole block."""
    ask = [{"role": "user", "content": "What is 17+25?"}]
    free = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=96, temperature=0)
    reasoning = free.choices[0].message.model_extra["reasoning_content"]
    stop = reasoning[6:10]
    cut = reasoning.index(stop)
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=96, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.content
    assert r.choices[0].message.model_extra["reasoning_content"] == reasoning[:cut].rstrip("\n")
    assert r.usage.completion_tokens <= cut + len(stop) < 32 < free.usage.completion_tokens
