"""Issue #44, the conversation side: through `clover serve`'s app on loopback with the official `openai`
client, the demo model writing calls to tools it never trained on (integers, strings, enums, nested
objects, arrays, optional fields — tests/test_forced_tool_calls.py's tools):
- `parallel_tool_calls: false` gives one call at most, under "required" and "auto";
- a follow-up turn after several calls (`role: "tool"` messages) reaches the model as transformers
  renders the same messages with the model's own template;
- a streamed answer, assembled by the openai SDK, equals the whole answer for the same seed —
  content, `reasoning_content`, calls and finish reason — and the thinking stays out of the content
  and the arguments;
- under "auto" (the server's default decoding), no call markup ever comes back in `content`, across
  more than 50 prompts."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import clover
from test_forced_tool_calls import SCHEMAS, TOOLS
from test_server import demo_client

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

MODEL = "clover-demo"
MARKUP = ("<tool_call", "</tool_call", "<function=", "</function", "<parameter=", "</parameter", "<think>", "</think>")


@pytest.fixture(scope="module")
def client():
    with demo_client(MODEL, max_batch=4, max_queue=16) as c:
        yield c


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(str(clover.DEMO_MODEL_DIR))


def body(prompt, choice="auto", messages=None, temperature=0.0, **extra):
    return dict(model=MODEL, messages=messages or [{"role": "user", "content": prompt}], tools=TOOLS,
                tool_choice=choice, max_tokens=96, temperature=temperature, extra_body=extra)


def check_message(message):
    """No markup or thinking in the content; every call's arguments validate against its tool's schema."""
    content = message.content or ""
    assert not any(tag in content for tag in MARKUP), content
    for call in message.tool_calls or []:
        args = call.function.arguments
        assert not any(tag in args for tag in MARKUP), args
        jsonschema.validate(json.loads(args), SCHEMAS[call.function.name])


def summary(choice):
    """What a client reads of an answer (call ids are per response, so left out; an empty content is
    "" whole and absent from a stream that sent no content delta)."""
    m = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return m.content or None, (m.model_extra or {}).get("reasoning_content"), calls, choice.finish_reason


def stream_assembled(client, kw):
    """The openai SDK's own assembly of the streamed answer, and the raw deltas' reasoning text."""
    with client.chat.completions.stream(**kw) as stream:
        reasoning = ""
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                reasoning += (event.chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        return stream.get_final_completion().choices[0], reasoning


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_parallel_tool_calls_false_gives_one_call_at_most(client, choice):
    prompts = ["Add 17 and 25, then look up the key alpha.", "Book Oslo for 2 on day 3 and add 4 and 5.",
               "What is 8+9? Also look up beta."]
    for prompt in prompts:
        for mode in ({}, {"block_size": 1}):
            r = client.chat.completions.create(**body(prompt, choice, parallel_tool_calls=False, **mode))
            message = r.choices[0].message
            check_message(message)
            assert len(message.tool_calls or []) <= 1
            if choice == "required":
                assert len(message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_a_follow_up_turn_after_several_calls(client, hf):
    """Turn 1 from the model (forced calls); the client answers every call with a `tool` message and,
    as a client that made two calls in one turn would, sends a turn with two calls and their results
    too. The prompt the model gets is transformers' rendering of the same messages (arguments as
    objects, the thinking kept), counted by `usage.prompt_tokens`; the answer is well formed."""
    ask = [{"role": "user", "content": "Add 17 and 25, then look up the key alpha."}]
    first = client.chat.completions.create(**body(None, "required", messages=ask))
    message = first.choices[0].message
    check_message(message)
    results = {"add": "42", "lookup": "7", "book": "booked"}
    history = ask + [message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": results[c.function.name]} for c in message.tool_calls]
    two = [{"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
           {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "beta"}'}}]
    history += [{"role": "user", "content": "And 2+3, and the key beta?"},
                {"role": "assistant", "content": None, "reasoning_content": "Both tools.", "tool_calls": two},
                {"role": "tool", "tool_call_id": "call_a", "content": "5"},
                {"role": "tool", "tool_call_id": "call_b", "content": "11"}]
    for stream in (False, True):
        kw = body(None, "auto", messages=history)
        final = stream_assembled(client, kw)[0] if stream else client.chat.completions.create(**kw).choices[0]
        check_message(final.message)
        assert (final.finish_reason == "tool_calls") == bool(final.message.tool_calls)
    r = client.chat.completions.create(**body(None, "auto", messages=history))

    def as_template_reads(m):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        return m
    expected = hf.apply_chat_template([as_template_reads(m) for m in history], tools=TOOLS, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(expected)
    rendered = hf.decode(expected)               # both calls of a turn, then both results in one user turn
    assert "</tool_call>\n<tool_call>\n<function=lookup>\n<parameter=key>\nbeta\n" in rendered
    assert "<tool_response>\n5\n</tool_response>\n<tool_response>\n11\n</tool_response>" in rendered


MODES = {"low_confidence": {}, "low_confidence_0.8": {"threshold": 0.8}, "autoregressive": {"block_size": 1},
         "self_speculative": {"decoding": "self_speculative"}}


@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_calls_assemble_to_the_whole_answer(client, mode):
    """The same request (sampled with one seed; self-speculative: greedy) streamed and whole: the SDK's
    assembly of the deltas is the whole answer; the deltas' reasoning is the message's
    `reasoning_content`, found in neither the content nor the arguments; with thinking off there is
    none."""
    cases = [("required", "Book Paris for 2 and 3 on day 4.", True), ("auto", "What is 17+25?", True),
             ("auto", "Look up the key gamma.", True), ("required", "Add 3 and 4.", False)]
    for seed, (choice, prompt, thinking) in enumerate(cases):
        sampling = {} if mode == "self_speculative" else dict(temperature=0.7, do_sample=True, seed=seed)  # greedy only
        kw = body(prompt, choice, **MODES[mode], **sampling, enable_thinking=thinking)
        whole = client.chat.completions.create(**kw).choices[0]
        streamed, reasoning = stream_assembled(client, kw)
        assert summary(streamed) == summary(whole), (choice, prompt)
        check_message(whole.message)
        whole_reasoning = (whole.message.model_extra or {}).get("reasoning_content")
        assert (whole_reasoning or "") == reasoning
        if thinking and reasoning.strip():
            assert reasoning.strip() not in (whole.message.content or "")
            assert all(reasoning.strip() not in c.function.arguments for c in whole.message.tool_calls or [])
        if not thinking:
            assert not whole_reasoning


def test_auto_never_returns_call_markup_in_content(client):
    """54 prompts under tool_choice "auto" with the server's default decoding: questions for each tool,
    a few combined, and plain ones; greedy and sampled. Calls come back as calls, never as text."""
    rng = random.Random(44)
    prompts = []
    for _ in range(12):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        prompts += [f"What is {a}+{b}?", f"Look up the key {rng.choice('abcdefgh')}{rng.randint(0, 99)}.",
                    f"Book {rng.choice(['Paris', 'Oslo'])} for {rng.randint(1, 5)} on day {rng.randint(1, 28)}.",
                    f"Add {a} and {b}, then look up the key k{b}."]
    prompts += ["Hello!", "Tell me a story.", "What can you do?", "Convert 5 km to m.", "Multiply 3 by 4.",
                "Which tools do you have?"]
    assert len(prompts) >= 50
    requests = [body(p, **({"do_sample": True, "temperature": 0.8, "seed": i} if i % 3 == 0 else {}))
                for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda kw: client.chat.completions.create(**kw).choices[0], requests))
    calls = 0
    for prompt, choice in zip(prompts, answers):
        check_message(choice.message)
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls), prompt
        calls += len(choice.message.tool_calls or [])
    assert calls >= 10, calls                   # the model did write calls: the check above was exercised
