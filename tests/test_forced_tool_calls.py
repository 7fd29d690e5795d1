"""Issue #44: calls forced by tool_choice ("required" or a named function) follow the offered tools'
parameter schemas whether or not they are strict, in every decoding mode, streamed and not — through
`clover serve`'s app on loopback with the official `openai` client, on tools the demo model never saw
(the issue's `add`/`lookup`, plus enums, nested objects, arrays and optional fields). Every call's
arguments are validated with jsonschema against the tool's own schema."""

from __future__ import annotations

import json

import pytest

from test_server import demo_client

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "clover-demo"


def fn(name, properties, required):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


ADD = fn("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
LOOKUP = fn("lookup", {"key": {"type": "string"}}, ["key"])
BOOK = fn("book", {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "guests": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                   "when": {"type": "object", "properties": {"day": {"type": "integer"}},
                            "required": ["day"], "additionalProperties": False},
                   "note": {"type": "string"}}, ["city", "when"])
TOOLS = [ADD, LOOKUP, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MODES = {"low_confidence": {}, "low_confidence_0.8": {"threshold": 0.8}, "autoregressive": {"block_size": 1},
         "self_speculative": {"decoding": "self_speculative"}}


@pytest.fixture(scope="module")
def client():
    with demo_client(MODEL, max_batch=2, max_queue=8) as c:
        yield c


def valid_calls(calls, names):
    assert calls, "no tool_calls"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def ask(client, choice, mode, stream, prompt="What is 17+25?", **extra):
    body = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=choice,
                max_tokens=96, temperature=0, extra_body={**MODES[mode], **extra})
    if not stream:
        r = client.chat.completions.create(**body)
        return r.choices[0].message, r.choices[0].finish_reason
    with client.chat.completions.stream(**body) as s:
        for _ in s:
            pass
        done = s.get_final_completion()
    return done.choices[0].message, done.choices[0].finish_reason


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("stream", [False, True])
def test_the_issues_required_case_validates(client, mode, stream):
    """The issue's case: tool_choice "required", no strict, "What is 17+25?" — once a broken call in
    content; now a call whose arguments validate, and no call markup in the content."""
    message, finish = ask(client, "required", mode, stream)
    valid_calls(message.tool_calls, SCHEMAS)
    assert finish == "tool_calls" and "<tool_call>" not in (message.content or "")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,prompt", [("add", "What is 17+25?"), ("book", "Book Oslo for 2 on day 3."),
                                         ("lookup", "Look up the key alpha.")])
def test_a_named_function_gets_valid_arguments(client, mode, name, prompt):
    message, finish = ask(client, {"type": "function", "function": {"name": name}}, mode, False, prompt)
    valid_calls(message.tool_calls, {name})
    assert finish == "tool_calls"


@pytest.mark.parametrize("thinking", [True, False])
def test_sampled_and_thinking_either_way(client, thinking):
    for seed in range(3):
        message, _ = ask(client, "required", "low_confidence", seed % 2 == 1, "Book Paris on day 1.",
                         enable_thinking=thinking, do_sample=True, seed=seed)
        valid_calls(message.tool_calls, SCHEMAS)


def test_a_schema_llguidance_cannot_compile_is_a_400_naming_the_tool(client):
    bad = fn("weird", {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, ["n"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=[ADD, bad], tool_choice="required", max_tokens=32)
    assert "tools.weird" in err.value.message, err.value.message


def test_auto_calls_are_well_formed_and_the_grammar_can_be_turned_off(client):
    for prompt in ["What is 17+25?", "Look up the key alpha.", "Book Oslo on day 3.", "Hello!"]:
        message, _ = ask(client, "auto", "low_confidence", False, prompt)
        assert "<tool_call>" not in (message.content or "")
        for call in message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    message, _ = ask(client, "auto", "low_confidence", False, tool_call_grammar=False)
    assert message is not None
    with pytest.raises(openai.BadRequestError, match="tool_call_grammar"):
        ask(client, "auto", "low_confidence", False, tool_call_grammar="no")
