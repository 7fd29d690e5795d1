"""The OpenAI tools API on /v1/chat/completions: request → template input and prompt; output → tool_calls.

`prepare_chat` validates `tools`, `tool_choice` and the messages (assistant `tool_calls` with JSON-string
arguments, `tool` results, `reasoning_content`), renders the model's own chat template with them and
returns the prompt ids with a `ToolPlan`. `ChatOutput` turns the text channels of a response into the
OpenAI message or stream deltas, parsing calls with `tool_calls.ToolCallStream` when tools are on.

tool_choice:
- "auto" (the default with tools): tools in the prompt, calls parsed from whatever the model writes.
- "none": tools left out of the prompt and nothing parsed, as if none were sent.
- "required" / a named function: the prompt itself opens the call after the generation prompt —
  `<tool_call>\\n<function=` (required) or `<tool_call>\\n<function=NAME>\\n` (named) — with thinking
  closed, since the call must be the first thing in the answer. The model writes the rest, held to
  the tools' schemas by constrained decoding (`structured.py`).
- Under "auto" a call the model opens follows the same grammar unless `tool_call_grammar: false`
  (then only `strict` tools are enforced); `parallel_tool_calls: false` keeps the first call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .protocol import APIError, bad_request
from .text import CONTENT, REASONING
from .tool_calls import ToolCallStream, assemble

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# Template variables the request itself fills.
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "add_generation_prompt"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None = None    # what the template lists (None: no tools)
    parse: bool = False                # parse calls out of the output
    prefill: str = ""                  # the call opening the prompt writes for the model
    parallel: bool = True              # parallel_tool_calls


def plan_tools(req) -> ToolPlan:
    """Validate `tools` / `tool_choice` / `parallel_tool_calls` and decide how the request uses them."""
    tools = req.tools or []
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f'tools.{i}: a tool must be {{"type": "function", "function": {{...}}}}', f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':', "
                              f"got {name!r}", f"tools.{i}.function.name")
        if name in names:
            raise bad_request(f"tools.{i}.function.name {name!r} is declared twice", f"tools.{i}.function.name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools.{i}.function.parameters must be a JSON schema object",
                              f"tools.{i}.function.parameters")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"tools.{i}.function.description must be a string", f"tools.{i}.function.description")
        names.append(name)
    parallel = (req.model_extra or {}).get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")

    if req.tool_choice is not None and not tools:          # as the OpenAI API answers it
        raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(tools, True, f"<tool_call>\n<function={name}>\n", parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                          "tool_choice")
    if choice == "none" or not tools:
        if choice == "required":
            raise bad_request('tool_choice "required" needs tools', "tool_choice")
        return ToolPlan(parallel=parallel)
    return ToolPlan(tools, True, "<tool_call>\n<function=" if choice == "required" else "", parallel)


def chat_messages(messages) -> list[dict]:
    """The request's messages as the chat template reads them (tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        msg = {"role": "system" if m.role == "developer" else m.role,
               "content": None if m.content is None else m.text()}
        if m.role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                if isinstance(extra.get(key), str):
                    msg["reasoning_content"] = extra[key]
                    break
            if extra.get("tool_calls"):
                msg["tool_calls"] = _calls(extra["tool_calls"], f"messages.{i}.tool_calls")
        if m.role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(extra.get(key), str):
                    msg[key] = extra[key]
        out.append(msg)
    return out


def _calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.{j} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}", f"{where}.{j}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.{j}.function.arguments must be a JSON object", f"{where}.{j}.function.arguments")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def prepare_chat(tokenizer, req, enable_thinking: bool, template_kwargs: dict) -> tuple[list[int], ToolPlan]:
    """Prompt ids for a chat request, rendered by the model's template, and the request's tool plan."""
    plan = plan_tools(req)
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise bad_request(f"chat_template_kwargs cannot set {', '.join(reserved)}: the request does",
                          "chat_template_kwargs")
    messages = chat_messages(req.messages)
    kwargs = {**template_kwargs, "enable_thinking": enable_thinking and not plan.prefill}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=plan.tools, **kwargs)
    except ImportError as exc:
        raise APIError(500, f"this chat needs jinja2 to render its template ({exc}): pip install jinja2",
                       "server_error", None, "missing_dependency") from None
    except Exception as exc:
        if not _template_error(exc):
            raise
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages", "invalid_messages") from None
    if plan.prefill:
        ids = ids + tokenizer.encode(plan.prefill)
    return ids, plan


def _template_error(exc: Exception) -> bool:
    """An error the template raised about its input (its raise_exception, a missing key), not a bug here."""
    try:
        import jinja2
    except ImportError:
        return False
    return isinstance(exc, jinja2.TemplateError)


class ChatOutput:
    """Text channels of one response → OpenAI message fields / stream deltas (tool calls parsed)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.stream = ToolCallStream(plan.tools, plan.prefill) if plan.parse else None

    def first_delta(self) -> dict:
        """The stream's opening delta. With tools, no content yet: a reply that is only calls must
        assemble to content null, as the whole response has it."""
        return {"role": "assistant"} if self.stream is not None else {"role": "assistant", "content": ""}

    def feed(self, delta: dict, last: bool = False) -> dict:
        """One delta ({"reasoning", "content"}) → the chunk's delta fields; `last`: the final one."""
        if self.stream is None:
            reasoning, content, calls = delta[REASONING], delta[CONTENT], []
        else:
            step = self.stream.finish if last else self.stream.feed
            reasoning, content, calls = step(delta[REASONING], delta[CONTENT])
            if not self.plan.parallel:
                calls = [c for c in calls if c["index"] == 0]
        out = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    @property
    def n_calls(self) -> int:
        n = self.stream.n_calls if self.stream is not None else 0
        return n if self.plan.parallel else min(n, 1)

    def finish_reason(self, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self.n_calls else finish

    def message(self, reasoning: str, content: str) -> dict:
        """The whole assistant message of a non-streamed response."""
        d = self.feed({REASONING: reasoning, CONTENT: content}, last=True)
        message = {"role": "assistant", "content": d.get("content", "")}
        if d.get("reasoning_content"):
            message["reasoning_content"] = d["reasoning_content"]
        if self.stream is not None and d.get("tool_calls"):
            _, calls = assemble(("tool", c) for c in d["tool_calls"])
            message["tool_calls"] = calls
            message["content"] = message["content"] or None
        return message
