"""The tool-call parser: XML calls → OpenAI tool_calls, typed by schema, whole and streamed; calls
inside thinking; malformed text returned as text. Expectations are written by hand, and streamed
deltas are assembled by the official `openai` client's own accumulator."""

import itertools
import json
import random

import pytest

from clover.server.tool_calls import ToolCallParser, ToolCallStream, assemble, parse_tool_calls, tool_schemas
from clover.server.tool_values import convert_value

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args(call):
    return json.loads(call["function"]["arguments"])


# ---- values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,schema,expected", [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),                       # a string stays a string
    (" 42 ", {"type": "integer"}, 42),
    ("-7", {"type": "integer"}, -7),
    ("3.0", {"type": "integer"}, 3),                        # JSON Schema: 3.0 is an integer
    ("3.5", {"type": "integer"}, "3.5"),                    # not one: returned as written
    ("2.5", {"type": "number"}, 2.5),
    ("10", {"type": "number"}, 10),
    ("1e3", {"type": "number"}, 1000.0),
    ("nan", {"type": "number"}, "nan"),
    ("inf", {"type": "number"}, "inf"),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1, 2], "b": null}', {"type": "object"}, {"a": [1, 2], "b": None}),
    ("{'a': True}", {"type": "object"}, {"a": True}),      # a Python literal, read safely
    ("[1, 2]", {"type": "object"}, "[1, 2]"),              # an array is not an object
    ('["x", 2]', {"type": "array"}, ["x", 2]),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("null", {"type": ["string", "null"]}, None),
    ("text", {"type": ["string", "null"]}, "text"),
    ("null", {"type": "string"}, "null"),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
    ("five", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "five"),
    ("2", {"enum": [1, 2, 3]}, 2),
    ("{\"x\": 1}", {"properties": {"x": {}}}, {"x": 1}),   # no type, but properties: an object
    ("[1]", None, "[1]"),                                  # unknown parameter: a string
    ("__import__('os')", {"type": "object"}, "__import__('os')"),
    # Readings that would not be valid JSON again stay text.
    ('{"a": NaN}', {"type": "object"}, '{"a": NaN}'),
    ("[1e999]", {"type": "array"}, "[1e999]"),
    ("{'a': b'x'}", {"type": "object"}, "{'a': b'x'}"),
    ("{'a': {1, 2}}", {"type": "object"}, "{'a': {1, 2}}"),
    ("{(1, 2): 3}", {"type": "object"}, "{(1, 2): 3}"),
    ("[" * 100000, {"type": "array"}, "[" * 100000),
    ("9" * 5000, {"type": "integer"}, "9" * 5000),
])
def test_convert_value(raw, schema, expected):
    value = convert_value(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_tool_schemas_reads_openai_tools():
    assert tool_schemas(TOOLS)["get_weather"] is SCHEMA
    assert tool_schemas([{"type": "function", "function": {"name": "f"}}]) == {"f": {}}
    assert tool_schemas(None) == {} and tool_schemas([{"bad": 1}, "x"]) == {}


# ---- whole outputs ---------------------------------------------------------------------------
def test_one_call_typed_arguments():
    text = xml("get_weather", city="New York", days="3", temp="-1.5", metric="true", opts='{"units": "C"}',
               tags='["a", "b"]', note="null")
    content, calls = parse_tool_calls(text, TOOLS, ids())
    assert content == ""
    assert calls == [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": "New York", "days": 3, "temp": -1.5, "metric": True, "opts": {"units": "C"}, "tags": ["a", "b"],
         "note": None})}}]


def test_parallel_calls_with_content_around():
    text = ("Let me check.\n\n" + xml("add", a="1", b="2") + "\n" + xml("get_weather", city="Oslo")
            + "\n\nBack soon.")
    content, calls = parse_tool_calls(text, TOOLS, ids())
    assert content == "Let me check.\n\nBack soon."
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert [args(c) for c in calls] == [{"a": 1, "b": 2}, {"city": "Oslo"}]


def test_values_keep_their_text():
    code = "def f():\n    return '</parameter>'\n</parameter> inside\n"
    text = ("<tool_call>\n<function=get_weather>\n<parameter=code>\n" + code + "\n</parameter>\n"
            "<parameter=city>\n\nTwo\nlines\n\n</parameter>\n</function>\n</tool_call>")
    _, (call,) = parse_tool_calls(text, TOOLS)
    # One newline trimmed each side; a </parameter> not followed by structure is part of the value.
    assert args(call) == {"code": code, "city": "\nTwo\nlines\n"}
    # Compact form, no newlines at all.
    _, (call,) = parse_tool_calls("<tool_call><function=add><parameter=a>1</parameter><parameter=b>2"
                                  "</parameter></function></tool_call>", TOOLS)
    assert args(call) == {"a": 1, "b": 2}


@pytest.mark.parametrize("text", [
    "I would use <tool_call> here, but no.",
    "<tool_call>\n<function=delete_everything>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "<function=add>\n<parameter=a>\n1\n</parameter>\n</function>",
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
    "<tool_call>\n<function=ad",
    "<tool_call>\n<function=add",
    "<tool_call>",
    "a < b > c </parameter> </function> </tool_call>",
    "",
])
def test_malformed_calls_come_back_as_text(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert (content, calls) == (text, [])


def test_no_tools_no_calls():
    text = xml("add", a="1")
    assert parse_tool_calls(text, None) == (text, [])
    assert parse_tool_calls(text, []) == (text, [])


def test_lenient_closers():
    # </tool_call> missing, then more content; </function> missing.
    content, calls = parse_tool_calls("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n"
                                      "ok", TOOLS)
    assert (content, [args(c) for c in calls]) == ("ok", [{"a": 1}])
    content, calls = parse_tool_calls("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
                                      TOOLS)
    assert (content, [args(c) for c in calls]) == ("", [{"a": 1}])


def test_stray_text_in_a_body_ends_the_call():
    text = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\noops, I meant 2\n</function>\n</tool_call>"
    content, calls = parse_tool_calls(text, TOOLS)
    assert [args(c) for c in calls] == [{"a": 1}]
    assert content == "oops, I meant 2\n</function>\n</tool_call>"


def test_truncated_call_keeps_completed_parameters():
    text = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2"
    content, calls = parse_tool_calls(text, TOOLS)
    assert (content, [args(c) for c in calls]) == ("", [{"a": 1}])
    # Cut right after a parameter's close: at the end of the output it counts.
    content, calls = parse_tool_calls("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>", TOOLS)
    assert [args(c) for c in calls] == [{"a": 1}]
    content, calls = parse_tool_calls("<tool_call>\n<function=add>\n", TOOLS)
    assert (content, [args(c) for c in calls]) == ("", [{}])


def test_duplicate_and_unknown_parameters():
    text = xml("add", a="1", zzz="[1, 2]").replace("</function>", "<parameter=a>\n9\n</parameter>\n</function>")
    _, (call,) = parse_tool_calls(text, TOOLS)
    assert call["function"]["arguments"] == '{"a": 1, "zzz": "[1, 2]"}'


def test_unicode_arguments_are_not_escaped():
    _, (call,) = parse_tool_calls(xml("get_weather", city="Zürich 日本"), TOOLS)
    assert call["function"]["arguments"] == '{"city": "Zürich 日本"}'


# ---- streaming -------------------------------------------------------------------------------
PIECES = ["<tool_call>", "</tool_call>", "<function=add>", "<function=get_weather>", "<function=nope>", "<function=",
          "</function>", "<parameter=a>", "<parameter=b>", "<parameter=city>", "<parameter=days>", "</parameter>",
          "\n", "\n", " ", "1", "2.5", "true", "Paris", "text", "<", ">", "/", "=", "{\"k\": [1]}"]


def random_text(rng, n):
    good = [xml("add", a=str(rng.randint(-9, 9)), b="0.5"), xml("get_weather", city="Rome", days="2", metric="no")]
    return "".join(rng.choice(good) if rng.random() < 0.15 else rng.choice(PIECES) for _ in range(n))


def random_chunks(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def stream_events(text_chunks, tools=TOOLS):
    parser = ToolCallParser(tools, ids())
    events = []
    for chunk in text_chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def test_streamed_equals_whole_on_random_text():
    """Any cut of any text (valid calls, fragments of the syntax, junk) parses to the same result, never
    raises, and every call's arguments are a JSON object."""
    rng = random.Random(0)
    n_calls = 0
    for trial in range(400):
        text = random_text(rng, rng.randint(0, 40))
        whole = parse_tool_calls(text, TOOLS, ids())
        assert assemble(stream_events(random_chunks(rng, text))) == whole, text
        assert assemble(stream_events(list(text))) == whole, text
        for call in whole[1]:
            assert isinstance(args(call), dict)
        n_calls += len(whole[1])
    assert n_calls > 50           # the random texts did hold calls


def test_streaming_deltas_as_the_openai_client_assembles_them():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    rng = random.Random(1)
    text = "Checking.\n\n" + xml("add", a="2", b="3") + "\n" + xml("get_weather", city="Paris", opts="{'x': 1}")
    for trial in range(20):
        stream = ToolCallStream(TOOLS)
        state = ChatCompletionStreamState()
        first = True
        for chunk in random_chunks(rng, text) + [None]:
            _, content, deltas = stream.feed(content=chunk) if chunk is not None else stream.finish()
            delta = {"role": "assistant"} if first else {}
            first = False
            if content:
                delta["content"] = content
            if deltas:
                delta["tool_calls"] = deltas
            state.handle_chunk(ChatCompletionChunk.model_validate({
                "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None if chunk is not None else "tool_calls"}]}))
        message = state.get_final_completion().choices[0].message
        assert message.content == "Checking."
        assert [(c.id, c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            (message.tool_calls[0].id, "function", "add", {"a": 2, "b": 3}),
            (message.tool_calls[1].id, "function", "get_weather", {"city": "Paris", "opts": {"x": 1}})]
        assert message.tool_calls[0].id != message.tool_calls[1].id


def test_header_streams_before_the_arguments():
    parser = ToolCallParser(TOOLS, ids())
    assert parser.feed("<tool_call>\n<function=add") == []            # the name could still grow
    assert parser.feed(">\n<parameter=a>\n1\n</parameter>") == [
        ("tool", {"index": 0, "id": "call_0", "type": "function", "function": {"name": "add", "arguments": ""}})]
    assert parser.feed("\n<param") == []                             # '<param' decides nothing yet
    assert parser.feed("eter=") == [("tool", {"index": 0, "function": {"arguments": '{"a": 1'}})]
    assert parser.feed("b>\n2\n</parameter>\n</function>") == [
        ("tool", {"index": 0, "function": {"arguments": ', "b": 2'}}),
        ("tool", {"index": 0, "function": {"arguments": "}"}})]
    assert parser.feed("\n</tool_call>\n\n") == [] and parser.finish() == []


def test_content_is_not_held_longer_than_needed():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello wor") == [("content", "Hello wor")]
    assert parser.feed("ld <tool") == [("content", "ld")]             # ' <tool' may open a call
    assert parser.feed("s> are fine") == [("content", " <tools> are fine")]
    assert parser.finish() == []


# ---- thinking --------------------------------------------------------------------------------
def run_stream(pieces, tools=TOOLS, prefill=""):
    """pieces: (reasoning, content) deltas as TextStream yields them → (reasoning, content, calls)."""
    stream = ToolCallStream(tools, prefill, ids())
    reasoning, content, deltas = "", "", []
    for r, c in pieces:
        out = stream.feed(r, c)
        reasoning, content, deltas = reasoning + out[0], content + out[1], deltas + out[2]
    out = stream.finish()
    events = [("content", content + out[1])] + [("tool", d) for d in deltas + out[2]]
    return (reasoning + out[0], *assemble(events))


def test_call_inside_thinking_ends_the_thinking():
    call = xml("add", a="1", b="2")
    for pieces in ([("Need the sum.\n\n" + call, "")],
                   [("Need the sum.\n", ""), ("\n<tool_", ""), (call[6:30], ""), (call[30:], "")]):
        reasoning, content, calls = run_stream(pieces)
        assert reasoning == "Need the sum."
        assert (content, [args(c) for c in calls]) == ("", [{"a": 1, "b": 2}])
    # </think> arriving after the call (the model closed its thinking late): still one call, no leftovers.
    reasoning, content, calls = run_stream([("Sum. " + call, ""), ("", "")])
    assert (reasoning, content, len(calls)) == ("Sum.", "", 1)


def test_tag_mentions_in_thinking_stay_thinking():
    for text in ("I could write <tool_call> but will not.", "Maybe <tool_call>\n<function=nope>\n is a tool?",
                 "Trailing <tool_call>\n<funct"):
        reasoning, content, calls = run_stream([(text[:12], ""), (text[12:], ""), ("", "Answer: 3")])
        assert (reasoning, content, calls) == (text, "Answer: 3", [])


def test_thinking_then_call_in_content():
    reasoning, content, calls = run_stream([("Think first.", ""), ("", "Calling.\n" + xml("add", a="4"))])
    assert (reasoning, content, [args(c) for c in calls]) == ("Think first.", "Calling.", [{"a": 4}])


def test_prefilled_calls():
    # tool_choice naming a function: the prompt opened the call already.
    reasoning, content, calls = run_stream([("", "<parameter=a>\n5\n</parameter>\n</function>\n</tool_call>")],
                                           prefill="<tool_call>\n<function=add>\n")
    assert (reasoning, content, [(c["function"]["name"], args(c)) for c in calls]) == ("", "", [("add", {"a": 5})])
    # tool_choice "required": the model names the tool.
    _, content, calls = run_stream([("", "get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>")],
                                   prefill="<tool_call>\n<function=")
    assert (content, [(c["function"]["name"], args(c)) for c in calls]) == ("", [("get_weather", {"city": "Lima"})])
    # ... and, with parallel_tool_calls, more calls after it (the grammar lets them follow).
    _, content, calls = run_stream([("", "get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n"
                                         "</tool_call>\n" + xml("add", a="4"))], prefill="<tool_call>\n<function=")
    assert (content, [(c["function"]["name"], args(c)) for c in calls]) == (
        "", [("get_weather", {"city": "Lima"}), ("add", {"a": 4})])
    # ... and names none: the text is returned, prefill included, as the call was malformed.
    _, content, calls = run_stream([("", "nothing>\n</function>")], prefill="<tool_call>\n<function=")
    assert (content, calls) == ("<tool_call>\n<function=nothing>\n</function>", [])


def test_thinking_stream_is_cut_invariant():
    rng = random.Random(2)
    for trial in range(200):
        reasoning_text = random_text(rng, rng.randint(0, 12))
        content_text = random_text(rng, rng.randint(0, 12)) if rng.random() < 0.7 else ""
        whole = run_stream([(reasoning_text, ""), ("", content_text)])
        pieces = [(r, "") for r in random_chunks(rng, reasoning_text)] + \
                 [("", c) for c in random_chunks(rng, content_text)]
        assert run_stream(pieces) == whole, (reasoning_text, content_text)
