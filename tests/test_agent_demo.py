"""The demo model (trained on tool use) as an agent: the two-step tool loop through `clover serve` with the official `openai`
client, on held-out problems of each demo tool, streaming and not.

Step one: the question with DEMO_TOOLS offered (tool_choice auto: the model decides) must come back as
one call with the arguments the question implies (expected arguments come from the problem generator,
independently of the model). Step two: the tool runs on the arguments the model wrote (`run_tool`),
its result goes back as a `tool` message, and the answer must be exact. The demo model is small and
its accuracy is measured, not perfect (docs/tools.md: tool-call accuracy), so each tool must succeed on at
least 7 of 8 problems — a model that does not call tools, or mangles arguments, fails that at once.
Each loop runs with the server's default decoding (LowConfidence, the call grammar under tool_choice
auto) and with self-speculative decoding (lossless: the autoregressive output, drafted in blocks).
"""

from __future__ import annotations

import json

import pytest

from clover.training.evaluate_tools import heldout_tool_problems
from clover.training.tool_tasks import DEMO_TOOLS, TOOL_TASK_NAMES, run_tool
from test_server import demo_client

openai = pytest.importorskip("openai")

MODEL = "clover-demo"
PER_TOOL = 8


@pytest.fixture(scope="module")
def client():
    with demo_client(MODEL, max_batch=4, max_queue=16) as c:
        yield c


def _ask(client, messages, stream: bool, decoding: dict):
    """One chat turn → (content, tool_calls as [{id, name, arguments}], finish_reason)."""
    kw = dict(model=MODEL, messages=messages, tools=DEMO_TOOLS, max_tokens=128, extra_body=decoding)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def _agent_loop(client, question: str, stream: bool, decoding: dict) -> tuple[dict | None, str]:
    """(the model's call with parsed arguments, its final answer) — the loop an agent runs."""
    messages = [{"role": "user", "content": question}]
    content, calls, finish = _ask(client, messages, stream, decoding)
    if finish != "tool_calls" or len(calls) != 1:
        return None, content
    call = calls[0]
    arguments = json.loads(call["arguments"])
    try:
        result = run_tool(call["name"], arguments)
    except (ValueError, KeyError, TypeError):
        return {"name": call["name"], "arguments": arguments}, ""
    messages += [{"role": "assistant", "content": content or None, "tool_calls": [
                     {"id": call["id"], "type": "function",
                      "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": result}]
    answer, more_calls, finish = _ask(client, messages, stream, decoding)
    assert finish == "stop" and not more_calls
    return {"name": call["name"], "arguments": arguments}, answer.strip()


DECODINGS = {"default": {}, "self_speculative": {"decoding": "self_speculative"}}   # default: LowConfidence


@pytest.mark.parametrize("decoding", list(DECODINGS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("task", TOOL_TASK_NAMES)
def test_demo_model_runs_the_tool_loop(client, task, stream, decoding):
    problems = [p for p in heldout_tool_problems(PER_TOOL, seed=77) if p[0] == task]
    assert len(problems) == PER_TOOL
    ok, misses = 0, []
    for _, call_turn, reply_turn, expected in problems:
        question = call_turn.messages[-1]["content"]
        call, answer = _agent_loop(client, question, stream, DECODINGS[decoding])
        if call == expected and answer == reply_turn.answer:
            ok += 1
        else:
            misses.append((question, call, answer))
    assert ok >= PER_TOOL - 1, misses


def test_demo_model_answers_without_a_tool_when_it_needs_none(client):
    """An evaluated task's question with the tools offered: a plain answer, no call."""
    from clover.training.tasks import TASK_NAMES, check_answer, sample_examples

    examples = [ex for t in TASK_NAMES for ex in sample_examples(2, "heldout", 5, tasks=[t])]
    ok = 0
    for ex in examples:
        content, calls, finish = _ask(client, ex.messages, stream=False, decoding=DECODINGS["self_speculative"])
        ok += finish == "stop" and not calls and check_answer(ex, content)
    assert ok >= len(examples) - 1
