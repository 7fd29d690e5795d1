"""Tool-use chats for the demo model: three small tools, and problems that need them.

The demo tools (`DEMO_TOOLS`, OpenAI function schemas) are what the demo model was trained to call:
`multiply` (arithmetic it cannot do itself), `lookup` (a key-value store) and `convert` (lengths
between km, m, cm and mm). `run_tool` is their reference implementation (docs/tools.md's agent example
and the tests call it; `lookup` reads a store you pass, or the deterministic demo store).

A tool problem is two training examples, as an agent loop sees them:
  - the *call turn*: tools offered in the system turn (a random subset holding the needed tool, in a
    random order), the user question → thinking that names the tool (`call multiply`), then the call
    in the template's XML format;
  - the *answer turn*: the same chat plus the assistant's call (its thinking kept or dropped, as
    clients do either) and the `<tool_response>` → thinking that names the tool (`multiply
    returned`), then the answer: the response's text verbatim (in training, half the multiply /
    convert ones respond with another problem's result, `stand_in_result`, so the answer is copied).
Neither thinking copies a number. Block decoding fills free text in parallel, and a copy whose length
varies shifts everything after it: a digit the thinking got wrong went on into the call, and an answer
that began after a copied result had to guess where it began. Without copies the call's values are
filled in order under the call grammar, and the answer starts at the same offset in every chat.
`convert` returns its result with the unit (`697000 cm`), so every answer is the tool's result
verbatim: each answer position copies the response's token at the same offset, where a bare number
left the unit's place to a count of the digits, which runs of zeros made LowConfidence get wrong.
Besides, the evaluated tasks (addition, …) appear with tools offered and no call: the model learns to
decide. Prompts render through the demo chat template (`chat_template.TOOL_CHAT_TEMPLATE`), the
text the server renders for the same messages. Splits are by the problem (`key`), as in `tasks.py`.
"""

from __future__ import annotations

import hashlib
import random
from decimal import Decimal
from typing import Any, Mapping

from clover.training.tasks import LETTERS, TASK_NAMES, Example, generate_example

UNITS = {"km": Decimal(1000), "m": Decimal(1), "cm": Decimal("0.01"), "mm": Decimal("0.001")}


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


MULTIPLY = _function("multiply", "Multiply two integers.",
                     {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
LOOKUP = _function("lookup", "Read the value stored under a key.", {"key": {"type": "string"}}, ["key"])
CONVERT = _function("convert", "Convert a length to another unit.",
                    {"value": {"type": "number"}, "unit": {"type": "string", "enum": list(UNITS)},
                     "to": {"type": "string", "enum": list(UNITS)}}, ["value", "unit", "to"])
DEMO_TOOLS = [MULTIPLY, LOOKUP, CONVERT]
_BY_NAME = {t["function"]["name"]: t for t in DEMO_TOOLS}
TOOL_TASK_NAMES = ("tool_multiply", "tool_lookup", "tool_convert")


def format_number(x: Decimal | int | float) -> str:
    """Plain decimal notation without trailing zeros or exponent: 3500, 3.5, 0.042."""
    d = Decimal(str(x))
    text = f"{d:f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def demo_store_value(key: str) -> int:
    """The demo store: a fixed value 0-999 for every key (a hash, so tests and examples agree)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 1000


def run_tool(name: str, arguments: Mapping[str, Any], store: Mapping[str, Any] | None = None) -> str:
    """The demo tools' results, as the text of a `tool` message. Raises ValueError on bad arguments."""
    if name == "multiply":
        return str(int(arguments["a"]) * int(arguments["b"]))
    if name == "lookup":
        key = str(arguments["key"])
        if store is not None:
            if key not in store:
                raise ValueError(f"no value stored under {key!r}")
            return str(store[key])
        return str(demo_store_value(key))
    if name == "convert":
        unit, to = arguments["unit"], arguments["to"]
        if unit not in UNITS or to not in UNITS:
            raise ValueError(f"units must be one of {', '.join(UNITS)}")
        return f"{format_number(Decimal(str(arguments['value'])) * UNITS[unit] / UNITS[to])} {to}"
    raise ValueError(f"unknown tool {name!r}")


MULTIPLY_TEMPLATES = ("What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}.",
                      "What's the product of {a} and {b}?", "How much is {a} x {b}?",
                      "Calculate {a} multiplied by {b}.")
LOOKUP_TEMPLATES = ("Look up {k}.", "What is stored under {k}?", "Find the value stored for key {k}.",
                    "Check the store: what is {k}?", "Read the stored value of {k}.",
                    "What value does the store hold for {k}?")
CONVERT_TEMPLATES = ("Convert {v} {u} to {t}.", "How many {t} is {v} {u}?", "What is {v} {u} in {t}?",
                     "Express {v} {u} in {t}.", "Change {v} {u} into {t}.")


def _multiply(rng: random.Random):
    a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in (rng.choice((2, 3)), rng.choice((2, 3))))
    args = {"a": a, "b": b}
    return rng.choice(MULTIPLY_TEMPLATES).format(a=a, b=b), args, f"{a}*{b}"


def _lookup(rng: random.Random):
    # a letter and one or two digits (`q7`, `b42`): digits are always single tokens, so the key reads
    # as the same few tokens in the question and the call — random letter strings fell
    # apart into whatever merges they happened to contain, and the small model could not copy them
    k = rng.choice(LETTERS) + str(rng.randint(0, 99))
    return rng.choice(LOOKUP_TEMPLATES).format(k=k), {"key": k}, k


def _convert(rng: random.Random):
    unit, to = rng.sample(list(UNITS), 2)
    v = rng.choice((rng.randint(1, 999), rng.randint(1, 99), Decimal(rng.randint(1, 999)) / 10))
    v_text = format_number(v)
    value = float(v) if isinstance(v, Decimal) else v
    args = {"value": value, "unit": unit, "to": to}
    question = rng.choice(CONVERT_TEMPLATES).format(v=v_text, u=unit, t=to)
    return question, args, f"{v_text}{unit}>{to}"


_PROBLEMS = {"tool_multiply": ("multiply", _multiply), "tool_lookup": ("lookup", _lookup),
             "tool_convert": ("convert", _convert)}


def pydantic_style(tool: dict) -> dict:
    """The same tool as frameworks that build schemas with pydantic send it (the OpenAI Agents SDK's
    `function_tool`): titled properties and parameters, no extra properties, `strict`."""
    fn = tool["function"]
    props = {}
    for key, prop in fn["parameters"]["properties"].items():
        title = key.replace("_", " ").title()
        props[key] = ({"enum": prop["enum"], "title": title, "type": prop["type"]} if "enum" in prop
                      else {"title": title, **prop})
    params = {"properties": props, "required": fn["parameters"]["required"], "title": f"{fn['name']}_args",
              "type": "object", "additionalProperties": False}
    return {"type": "function", "function": {"name": fn["name"], "description": fn["description"],
                                             "parameters": params, "strict": True}}


SYSTEM_PROMPTS = ("You are a helpful assistant.", "Use the tools when they help.", "Answer the question.",
                  "You are an agent. Call a tool when you need one.", "Be brief.")


def offered_tools(rng: random.Random, needed: str | None) -> list[dict]:
    """A random non-empty subset of the demo tools holding `needed`, in a random order; a third of
    the time in the pydantic style (`pydantic_style`), so framework-built schemas read the same."""
    others = [t for t in DEMO_TOOLS if t["function"]["name"] != needed]
    chosen = rng.sample(others, rng.randint(0 if needed else 1, len(others)))
    if needed:
        chosen.append(_BY_NAME[needed])
    rng.shuffle(chosen)
    if rng.random() < 1 / 3:
        chosen = [pydantic_style(t) for t in chosen]
    return chosen


def _with_system(messages: list[dict], rng: random.Random) -> list[dict]:
    """A quarter of training chats open with a short system message (agents send instructions)."""
    if rng.random() < 0.25:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
    return messages


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the template renders an assistant `tool_calls` entry."""
    params = "".join(f"<parameter={k}>\n{format_value(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def format_value(v: Any) -> str:
    """A parameter value as the template's `tojson` writes it (strings bare)."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)            # numbers: str() is json.dumps's text for them (3.0 stays "3.0")


def tool_problem(task: str, rng: random.Random, tools: list[dict] | None = None,
                 result: str | None = None) -> tuple[Example, Example, dict]:
    """(call-turn example, answer-turn example, the expected call {name, arguments}) of one problem.
    `tools` fixes the offered tools (eval: all of DEMO_TOOLS); `result` the tool's answer (else a
    random store value for lookup, the true result for the others)."""
    name, problem = _PROBLEMS[task]
    question, args, key = problem(rng)
    user = [{"role": "user", "content": question}]
    if tools is None:
        tools = offered_tools(rng, name)
        user = _with_system(user, rng)
    call_thinking = f"call {name}"
    call = Example(task, user, call_thinking, call_text(name, args), f"{task}:{key}", tools=tuple(tools))
    if result is None:
        result = str(rng.randint(0, 999)) if name == "lookup" else run_tool(name, args)
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    if rng.random() < 0.5:
        assistant["reasoning_content"] = call_thinking
    history = user + [assistant, {"role": "tool", "content": result}]
    reply = Example(task, history, f"{name} returned", result, f"{task}:{key}", tools=tuple(tools))
    return call, reply, {"name": name, "arguments": args}


STAND_IN_SHARE = 0.5


def stand_in_result(name: str, rng: random.Random) -> str:
    """The result of another random problem for the same tool: a number of the right shape (runs of
    zeros, a unit) that the question does not determine. A `STAND_IN_SHARE` of multiply / convert
    answer turns train on one, as lookup's always do, so the answer copies the response position by
    position instead of working the result out again from the question (which, under LowConfidence,
    miscounted runs of zeros: `583000 mm` came back as `58300 mm`)."""
    _, problem = _PROBLEMS[f"tool_{name}"]
    return run_tool(name, problem(rng)[1])


def generate_tool_example(task: str, rng: random.Random) -> Example:
    """One training example of a tool task: a call turn or an answer turn (even odds), or — for
    `tool_none` — an evaluated task's question with tools offered that it answers without a call."""
    if task == "tool_none":
        ex = generate_example(rng.choice(TASK_NAMES), rng)
        return Example(ex.task, _with_system(ex.messages, rng), ex.thinking, ex.answer, ex.key,
                       tools=tuple(offered_tools(rng, None)))
    if rng.random() < 0.5:
        return tool_problem(task, rng)[0]
    name = _PROBLEMS[task][0]
    result = stand_in_result(name, rng) if name != "lookup" and rng.random() < STAND_IN_SHARE else None
    return tool_problem(task, rng, result=result)[1]
