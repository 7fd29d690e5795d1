"""Tool calls in the model's text → OpenAI `tool_calls`, whole or as streaming deltas.

The model writes calls in Qwen3.6's XML format (the demo template's, see `chat_template.py`):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

`ToolCallParser` reads that text incrementally. Text outside calls is content; each call becomes a
tool call whose `arguments` JSON is built parameter by parameter, every value typed by the tool's JSON
schema (`tool_values.convert_value`). The non-streaming answer (`parse_tool_calls`) is the parser's own deltas
assembled, so streamed and whole responses agree by construction. Rules (vLLM's qwen3 coder / xml
parsers were read for the behaviour; this is a separate, simpler state machine):

- A call starts at `<tool_call>`, optional whitespace, `<function=NAME>` with NAME a declared tool.
  Anything else (a bare `<tool_call>` in prose, an undeclared name, `<function=` without
  `<tool_call>`) is content, unchanged: a malformed call is returned as text, never an error.
- A value is the text between `<parameter=ARG>\\n` and `\\n</parameter>` (one newline trimmed each
  side). `</parameter>` ends it only when followed, after whitespace, by `<parameter=`, `</function>`
  or `</tool_call>`, so a value may itself contain `</parameter>` (code, say); at the end of the output
  with no such close, the first `</parameter>` ends it. Duplicate parameters:
  the first wins (a streamed argument cannot be taken back).
- Inside a function body, text that is neither whitespace nor a parameter ends the call there: the
  call keeps the parameters before it and that text is content again. `</function>` without
  `</tool_call>` (or `</tool_call>` without `</function>`) also closes the call.
- At the end of the output an unclosed call keeps its completed parameters (the finish reason,
  `length`, says it was cut); a parameter without its close is dropped.
- Calls are cut out of the text with the whitespace around them (the template's separators); content
  on both sides of calls keeps the whitespace that came before the first of them.

Calls inside thinking (`ToolCallStream`): as vLLM's Qwen3 reasoning parser treats a `<tool_call>`
followed by `<function=…>` as an implicit `</think>` (Qwen3.5 models call tools without closing
their thinking), a complete call header naming a declared tool ends the reasoning: from `<tool_call>`
on, the text is parsed as content and calls. vLLM's non-streaming path instead keeps a call that is
followed by `</think>` inside the reasoning while its streaming path does not; we apply the
streaming rule in both modes so they agree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Iterable

from .tool_values import convert_value

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_NAME_END = ">"
_WS = " \t\r\n"


def tool_schemas(tools: Iterable[dict] | None) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI `tools` ([{"type": "function", "function": {...}}])."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


# ---- the incremental parser --------------------------------------------------------------------
def _is_prefix(text: str, *tokens: str) -> bool:
    """`text` is a proper beginning of some token (more text could complete it)."""
    return any(len(text) < len(t) and t.startswith(text) for t in tokens)


def _partial_tail(text: str, token: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `token`."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


def call_header(text: str, names) -> tuple[str, int] | None | bool:
    """Does `text` (starting at `<tool_call>`) open a call of a declared tool?

    (name, header length) if it does; True if more text could still make it one; None if not."""
    rest = text[len(CALL_OPEN):]
    body = rest.lstrip(_WS)
    skipped = len(rest) - len(body)
    if not body or _is_prefix(body, FUNC_OPEN):
        return True
    if not body.startswith(FUNC_OPEN):
        return None
    end = body.find(_NAME_END, len(FUNC_OPEN))
    name = body[len(FUNC_OPEN):end if end >= 0 else len(body)]
    if end < 0:
        # Still reading the name: it can only become a declared one.
        return True if any(n.startswith(name) for n in names) else None
    if name not in names:
        return None
    return name, len(CALL_OPEN) + skipped + end + 1


class ToolCallParser:
    """Text in, events out: ("content", str) and ("tool", OpenAI tool-call delta dict).

    Deltas have the shape the `openai` client assembles: the first for a call carries index, id,
    type and the name with empty arguments; later ones carry only index and an arguments fragment.
    Concatenated, a call's fragments are `json.dumps` of its arguments."""

    def __init__(self, tools: Iterable[dict] | None, new_id: Callable[[], str] | None = None):
        self.schemas = tool_schemas(tools)
        self.new_id = new_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        self._buf = ""               # text not yet decided
        self._state = "text"         # text | body | after_function
        self._ws = ""                # content whitespace held back (dropped if a call follows)
        self._after_call = False     # drop whitespace right after a call
        self._said = False           # some content was emitted
        self._gap = ""               # whitespace before a run of calls, if content came before
        self._index = -1             # index of the current / last call
        self._args: dict[str, Any] = {}
        self._name = ""
        self.n_calls = 0

    # -- public
    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        events = self._run(final=True)
        if self._state != "text":
            events.append(self._close_call())
            self._state = "text"
        if self._buf:
            self._content(events, self._buf)
            self._buf = ""
        if self._ws and not self._after_call:
            events.append(("content", self._ws))
        self._ws = ""
        return events

    # -- the state machine
    def _run(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            step = {"text": self._text, "body": self._body, "after_function": self._after_function}[self._state]
            if not step(events, final):
                return events

    def _text(self, events, final) -> bool:
        i = self._buf.find(CALL_OPEN)
        if i < 0:
            keep = 0 if final else _partial_tail(self._buf, CALL_OPEN)
            self._content(events, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(events, self._buf[:i])
        self._buf = self._buf[i:]
        header = call_header(self._buf, self.schemas)
        if header is True and not final:
            return False                          # wait: it may still become a call
        if not isinstance(header, tuple):         # not a call: the tag is text
            self._content(events, CALL_OPEN)
            self._buf = self._buf[len(CALL_OPEN):]
            return True
        name, length = header
        self._buf = self._buf[length:]
        if self._said and not self._after_call:
            self._gap = self._ws             # kept for content after the call(s)
        self._ws = ""
        self._index += 1
        self.n_calls += 1
        self._name, self._args, self._state = name, {}, "body"
        events.append(("tool", {"index": self._index, "id": self.new_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}))
        return True

    def _body(self, events, final) -> bool:
        body = self._buf.lstrip(_WS)
        if body.startswith(FUNC_CLOSE):
            self._buf = body[len(FUNC_CLOSE):]
            events.append(self._close_call())
            self._state = "after_function"
            return True
        if body.startswith(CALL_CLOSE):
            self._buf = body[len(CALL_CLOSE):]
            events.append(self._close_call())
            self._end_call()
            return True
        if body.startswith(PARAM_OPEN):
            end = body.find(_NAME_END, len(PARAM_OPEN))
            if end < 0:
                return False if not final else self._drop_rest()
            value_end = self._value_end(body, end + 1, final)
            if value_end is None:
                return False if not final else self._drop_rest()
            name = body[len(PARAM_OPEN):end]
            value = body[end + 1:value_end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            self._buf = body[value_end + len(PARAM_CLOSE):]
            if name not in self._args:
                events.append(self._argument(name, value))
            return True
        if not body:
            self._buf = ""                         # whitespace between parameters means nothing
            return False
        if _is_prefix(body, FUNC_CLOSE, CALL_CLOSE, PARAM_OPEN) and not final:
            return False
        # Something else inside the function: the call ends here and the text is content again.
        self._buf = body
        events.append(self._close_call())
        self._state = "text"
        self._after_call = False
        return True

    def _value_end(self, body: str, start: int, final: bool) -> int | None:
        """Where the value starting at `start` ends: a `</parameter>` followed by structure."""
        pos, first = start, None
        while (j := body.find(PARAM_CLOSE, pos)) >= 0:
            first = j if first is None else first
            after = body[j + len(PARAM_CLOSE):].lstrip(_WS)
            if after.startswith((PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE)):
                return j
            if not after or _is_prefix(after, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE):
                return j if final else None        # what follows decides; wait for it
            pos = j + 1
        # At the end of the output with no structural close: the first close ends the value (and the
        # text after it, not being structure, ends the call).
        return first if final else None

    def _after_function(self, events, final) -> bool:
        rest = self._buf.lstrip(_WS)
        if rest.startswith(CALL_CLOSE):
            self._buf = rest[len(CALL_CLOSE):]
        elif not final and (not rest or _is_prefix(rest, CALL_CLOSE)):
            return False
        self._end_call()
        return True

    def _drop_rest(self) -> bool:
        """End of output inside a parameter: the unfinished parameter is dropped."""
        self._buf = ""
        return False

    # -- helpers
    def _argument(self, name: str, raw: str) -> tuple[str, dict]:
        props = self.schemas.get(self._name, {}).get("properties")
        schema = props.get(name) if isinstance(props, dict) else None
        value = convert_value(raw, schema)
        fragment = ("{" if not self._args else ", ") + json.dumps(name, ensure_ascii=False) + ": " \
            + json.dumps(value, ensure_ascii=False)
        self._args[name] = value
        return "tool", {"index": self._index, "function": {"arguments": fragment}}

    def _close_call(self) -> tuple[str, dict]:
        self._state = "closed"
        return "tool", {"index": self._index, "function": {"arguments": "}" if self._args else "{}"}}

    def _end_call(self) -> None:
        self._state, self._after_call = "text", True

    def _content(self, events, text: str) -> None:
        """Content, with whitespace next to calls held back and dropped."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            text, self._gap, self._after_call = self._gap + text, "", False
        text = self._ws + text
        body = text.rstrip(_WS)
        self._ws = text[len(body):]
        if body:
            events.append(("content", body))
            self._said = True


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of one call merged into one (fewer, larger SSE chunks; same assembly)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def assemble(events: Iterable[tuple[str, Any]]) -> tuple[str, list[dict]]:
    """Parser events → (content, tool_calls) as a whole message carries them."""
    content, calls = [], []
    for kind, value in events:
        if kind == "content":
            content.append(value)
        elif "id" in value:
            calls.append({"id": value["id"], "type": "function",
                          "function": {"name": value["function"]["name"],
                                       "arguments": value["function"].get("arguments", "")}})
        else:
            calls[value["index"]]["function"]["arguments"] += value["function"]["arguments"]
    return "".join(content), calls


def parse_tool_calls(text: str, tools: Iterable[dict] | None,
                     new_id: Callable[[], str] | None = None) -> tuple[str, list[dict]]:
    """A whole output → (content, tool_calls). Never raises on malformed text."""
    parser = ToolCallParser(tools, new_id)
    return assemble(parser.feed(text) + parser.finish())


class ToolCallStream:
    """A chat response's (reasoning, content) deltas → (reasoning, content, tool-call deltas).

    Sits after `TextStream` (which splits thinking at `<think>`/`</think>`). Reasoning text is watched
    for a call header: one naming a declared tool ends the reasoning there (see the module docstring)
    and everything from it on, reasoning or content, goes through the `ToolCallParser`. `prefill` is
    text the prompt already wrote for the model (tool_choice `required` / a named function): parsed
    first, its content never returned."""

    def __init__(self, tools: Iterable[dict] | None, prefill: str = "", new_id: Callable[[], str] | None = None):
        self.parser = ToolCallParser(tools, new_id)
        self._pending = [e for e in self.parser.feed(prefill) if e[0] == "tool"] if prefill else []
        self._held = ""                  # reasoning that may still open a call
        self._thinking_over = False      # reasoning ended at a call: later reasoning is parsed

    @property
    def n_calls(self) -> int:
        return self.parser.n_calls

    def feed(self, reasoning: str = "", content: str = "") -> tuple[str, str, list[dict]]:
        events, self._pending = self._pending, []
        out_reasoning = ""
        if reasoning:
            if self._thinking_over:
                events += self.parser.feed(reasoning)
            else:
                out_reasoning, events = self._watch(reasoning, events, final=False)
        if content:
            if not self._thinking_over and self._held:     # </think> came: held text was reasoning
                out_reasoning, self._held = out_reasoning + self._held, ""
            events += self.parser.feed(content)
        return (out_reasoning, *self._split(events))

    def finish(self, reasoning: str = "", content: str = "") -> tuple[str, str, list[dict]]:
        """The last deltas (pass `TextStream.flush()`'s text): held reasoning and any open call."""
        out_reasoning, out_content, deltas = self.feed(reasoning, content)
        events = []
        if self._held and not self._thinking_over:
            more, events = self._watch("", events, final=True)
            out_reasoning += more
        events += self.parser.finish()
        more_content, more_deltas = self._split(events)
        return out_reasoning, out_content + more_content, merge_deltas(deltas + more_deltas)

    def _watch(self, reasoning: str, events: list, final: bool) -> tuple[str, list]:
        """Reasoning out, up to a confirmed call header (whose text moves to the parser)."""
        text = self._held + reasoning
        pos = 0
        while (i := text.find(CALL_OPEN, pos)) >= 0:
            header = call_header(text[i:], self.parser.schemas)
            if isinstance(header, tuple):
                self._held, self._thinking_over = "", True
                return text[:i].rstrip(_WS), events + self.parser.feed(text[i:])
            if header is True and not final:
                break
            pos = i + 1
        else:
            i = len(text) - (0 if final else _partial_tail(text, CALL_OPEN))
        if final:
            self._held = ""
            return text, events
        body = text[:i].rstrip(_WS)        # whitespace before a possible call waits with it
        self._held = text[len(body):]
        return body, events

    @staticmethod
    def _split(events) -> tuple[str, list[dict]]:
        content = "".join(v for k, v in events if k == "content")
        return content, merge_deltas([v for k, v in events if k == "tool"])
