"""Structured output on /v1/chat/completions: `response_format` and tool calls → a grammar.

`response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` become an llguidance JSON-schema grammar for the answer.
Tools, strict or not (clients rarely mark them), become a Lark grammar: under tool_choice "required"
or a named function for the rest of the call the prompt opened
(`NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n…`), each value written as the template writes it
(strings raw, other types as JSON of their schema), more calls after it when `parallel_tool_calls`.
Under tool_choice "auto" the answer is free text without the call format's tags, and a call it opens
(`<tool_call>`) must be written whole to a declared function, by its schema — unless the request
sets `tool_call_grammar: false`. With `strict`, what the grammar cannot promise
(pattern, format, lengths of a raw string; a string-or-other union) is a 400; without, it is not enforced. When the prompt leaves the
model thinking, the grammar lets it think first and governs what follows `</think>` (under "auto", a
call written inside the thinking ends it, as the tool-call parser reads it, and is constrained too).
Schemas are compiled before the request is queued: a schema llguidance cannot compile, or a budget
(max_tokens) too small for the shortest valid answer, is a 400. The decoding side is
`generation/constrained.py`; the grammar library wrapper is `clover/grammar.py`.
"""

from __future__ import annotations

import json
import re

from ..grammar import GrammarError, Grammars
from .protocol import bad_request

FORMATS = ("text", "json_object", "json_schema")
# Raw string values of strict tool parameters: one line, no '<' (so no markup can start inside one).
_RAW_STRING = r"/[^\n<]*/"
# The call format's tags, which free text under "auto" may not hold: a `<tool` there is a call's
# opening (`<tool_call>`, then the call by its schema), so a call written out of order by block
# decoding (`<toolcall>`, a `<function=` without its opening) cannot come back as text.
_TAGS = "|".join(["<tool", "<function", "<parameter", "<\\/tool_call", "<\\/function", "<\\/parameter"])
_WALK_LIMIT = 4096          # the longest closing path looked for when the budget cannot hold one


def answer_schema(response_format: dict | None) -> dict | None:
    """The JSON schema `response_format` asks the answer to follow (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind not in FORMATS:
        raise bad_request(f"response_format.type must be one of {', '.join(FORMATS)}, got {kind!r}",
                          "response_format.type", "invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                          "response_format.json_schema", "invalid_value")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string",
                          "response_format.json_schema.name", "invalid_value")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise bad_request("response_format.json_schema.strict must be true or false",
                          "response_format.json_schema.strict", "invalid_value")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format.json_schema.schema", "invalid_schema")
    return schema


def call_lark(tools: list[dict], prefill: str, parallel: bool = False) -> str:
    """Lark for the rest of a call the prompt opened (`prefill`): to the named function, or to any of
    `tools` under "required" (and, when `parallel`, more calls after it, as the template joins them)
    — strict or not, each call follows the parameters' schemas."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if prefill.endswith(">\n"):                      # named: "<tool_call>\n<function=NAME>\n"
        return "start: " + _body_rules(functions[prefill[len("<tool_call>\n<function="):-2]], "f0")
    alts, rules = _function_rules(tools)
    more = ' ("\\n<tool_call>\\n<function=" call)*' if parallel else ""
    return "\n".join(["start: call" + more, "call: " + " | ".join(alts), *rules])


def auto_lark(tools: list[dict], parallel: bool, think_end_id: int | None) -> str:
    """Lark for tool_choice "auto": any text without `<tool_call>`, and each `<tool_call>` it writes
    followed by a whole call to one of `tools` by its schema. One call at most unless `parallel`.
    `think_end_id`: the response thinks first, and the thinking ends at `</think>` or at a call."""
    alts, rules = _function_rules(tools)
    more = "*" if parallel else "?"
    start = (f"start: TEXT <[{think_end_id}]> answer | call_open call {'answer' if parallel else 'TEXT'}"
             if think_end_id is not None else "start: answer")
    return "\n".join([
        start,
        f"answer: (call_open call){more} TEXT",
        f"call_open[lazy]: /(.|\\n)*<tool_call>/ & ~/(.|\\n)*({_TAGS})(.|\\n)*<tool_call>/",   # text, then <tool_call>
        'call: "\\n<function=" (' + " | ".join(alts) + ")",
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*({_TAGS})(.|\\n)*/",
        *rules])


def _function_rules(tools: list[dict]) -> tuple[list[str], list[str]]:
    """One alternative per function (`NAME>\\n` then its body) and the rules they use."""
    alts, rules = [], []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        alts.append(f"f{k}")
        rules.append(f"f{k}: {json.dumps(fn['name'] + '>' + chr(10))} " + _body_rules(fn, f"f{k}"))
    return alts, rules


def _body_rules(fn: dict, prefix: str) -> str:
    """`params "</function>\\n</tool_call>"` for one function, followed by its rules' lines."""
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    where = f"tools.{fn['name']}.parameters"
    if params.get("type", "object") != "object" or not isinstance(params.get("properties", {}), dict):
        raise bad_request(f"{where}: a function's parameters must be an object schema", "tools", "invalid_schema")
    required = params.get("required", [])
    if not isinstance(required, list):
        raise bad_request(f"{where}.required must be a list", "tools", "invalid_schema")
    seq, lines = [], []
    for k, (arg, schema) in enumerate(params.get("properties", {}).items()):
        rule = f"{prefix}_p{k}"
        open_ = json.dumps(f"<parameter={arg}>\n")
        lines.append(f"{rule}: {open_} {_value(schema, f'{where}.properties.{arg}', bool(fn.get('strict')))} " + json.dumps("\n</parameter>\n"))
        seq.append(rule if arg in required else rule + "?")
    if not fn.get("strict") and params.get("additionalProperties", True) is not False:
        # undeclared parameters the schema allows: any name, a raw one-line value
        lines.append(f'{prefix}_x: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {_RAW_STRING} "\\n</parameter>\\n"')
        seq.append(f"{prefix}_x*")
    head = " ".join(seq + [json.dumps("</function>\n</tool_call>")])
    return head + ("\n" + "\n".join(lines) if lines else "")


def _value(schema, where: str, strict: bool) -> str:
    """One parameter's value as the template writes it: a raw string, else JSON of its schema. A
    string's pattern/format/length, and a union with strings, are enforced only when `strict` (400
    there); otherwise such a value is a raw one-line string."""
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", "tools", "invalid_schema")
    types = schema.get("type")
    if types is None and not strict and not {"enum", "const", "anyOf", "oneOf", "allOf", "$ref"} & set(schema):
        return _RAW_STRING                          # an untyped value: written as the model writes it
    if types == "string":
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [schema.get("const")])
            if not values or not all(isinstance(v, str) and "\n" not in v and "<" not in v for v in values):
                raise bad_request(f"{where}: a string enum needs one-line values without '<'", "tools",
                                  "invalid_schema")
            return "(" + " | ".join(json.dumps(v) for v in values) + ")"
        for key in ("pattern", "format", "minLength", "maxLength"):
            if key in schema and strict:
                raise bad_request(f"{where}: {key} on a raw string parameter is not supported in strict mode",
                                  "tools", "unsupported")
        return _RAW_STRING
    if isinstance(types, list) and "string" in types or any("string" == s.get("type") for s in
                                                            schema.get("anyOf", []) if isinstance(s, dict)):
        if not strict:
            return _RAW_STRING
        raise bad_request(f"{where}: a strict parameter may be a string or another type, not both (strings are "
                          "written raw, other values as JSON)", "tools", "unsupported")
    return Grammars.json_rule(schema)


class StructuredOutput:
    """Grammars for one server's tokenizer, compiled per request (llguidance caches the heavy parts)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars: dict[tuple, Grammars] = {}

    def grammars(self, eos_ids) -> Grammars:
        key = tuple(eos_ids)
        if key not in self._grammars:
            self._grammars[key] = Grammars(self.tokenizer.tokenizer, self.vocab_size, key,
                                           self.tokenizer.think_end_token_id)
        return self._grammars[key]

    def lark(self, req, plan, thinking: bool) -> tuple[str, str, bool, list | None] | None:
        """(Lark grammar, the request field it comes from, whether the model thinks first, the tools it
        covers) for a chat request, or None (unconstrained). A forced call (required / named) always
        follows the tools' schemas; under "auto" a call the model opens does too, unless the request
        sets `tool_call_grammar: false` (then only strict tools are held to it)."""
        schema = answer_schema(req.response_format)
        if schema is not None and plan.parse:
            raise bad_request("response_format other than text cannot be combined with tools that may be called: "
                              'use tool_choice "none"', "response_format", "unsupported")
        if plan.prefill and plan.tools:            # the prompt opened the call with thinking off
            return call_lark(plan.tools, plan.prefill, plan.parallel), "tools", False, plan.tools
        if plan.parse and _auto_grammar(req, plan.tools):   # "auto": the thinking is in its grammar
            think_end = self.tokenizer.think_end_token_id if thinking else None
            if thinking and think_end is None:
                raise bad_request("this model has no </think> token: tool calls cannot be enforced "
                                  'while it thinks (set "tool_call_grammar": false)', "tools", "unsupported")
            return auto_lark(plan.tools, plan.parallel, think_end), "tools", False, plan.tools
        if schema is None:
            return None
        return "start: " + Grammars.json_rule(schema), "response_format", thinking, None

    def matcher(self, lark: str, param: str, thinking: bool, tools: list | None, settings):
        """A request's matcher (runs in a worker thread: compiling may take a while). 400 on a grammar
        llguidance refuses, on ignore_eos, and on a max_tokens that cannot hold the shortest answer."""
        if not settings.eos_token_id:
            raise bad_request("structured output needs an end token: ignore_eos cannot be combined with it",
                              "ignore_eos", "unsupported")
        try:
            grammars = self.grammars(settings.eos_token_id)
            if thinking:
                lark = grammars.with_thinking(lark)
            matcher = grammars.matcher(grammars.compile(lark))
        except GrammarError as exc:
            culprit = self._culprit(tools, settings) if tools else None
            raise bad_request(f"{culprit or param}: the schema cannot be enforced: {_first_line(exc)}", param,
                              "invalid_schema") from None
        if matcher.closing(settings.max_new_tokens) is None:
            # The closing walk is greedy: where it finds no end at all (a pattern or format it cannot
            # satisfy by closers), the request runs without the budget guarantee rather than be refused.
            shortest = matcher.closing(_WALK_LIMIT)
            if shortest is not None:
                raise bad_request(f"max_tokens {settings.max_new_tokens} is too small for this {param}: the "
                                  f"shortest valid answer found takes {len(shortest)} tokens", "max_tokens",
                                  "invalid_value")
        return matcher

    def _culprit(self, tools: list, settings) -> str | None:
        """The first tool whose own call grammar llguidance refuses, as `tools.NAME` (for the 400)."""
        grammars = self.grammars(settings.eos_token_id)
        for tool in tools:
            try:
                grammars.compile(call_lark([tool], "<tool_call>\n<function="))
            except GrammarError:
                return f"tools.{tool['function']['name']}"
        return None


def _auto_grammar(req, tools) -> bool:
    """Whether calls under "auto" follow the grammar: by default; `tool_call_grammar: false` leaves
    them free unless a tool is strict (400 when only some are: a free call cannot be mixed in)."""
    on = (req.model_extra or {}).get("tool_call_grammar", True)
    if not isinstance(on, bool):
        raise bad_request("tool_call_grammar must be true or false", "tool_call_grammar", "invalid_value")
    strict = [t for t in tools if t["function"].get("strict")]
    if not on and strict and len(strict) != len(tools):
        raise bad_request('tool_call_grammar false with strict tools needs every tool strict', "tools", "unsupported")
    return on or bool(strict)


def _first_line(exc: Exception) -> str:
    """llguidance's message without its grammar position ("at 3(9): ") and state dump."""
    text = re.sub(r"^at \d+\(\d+\): ", "", str(exc).strip())
    text = " ".join(line.strip() for line in text.split("<state>")[0].splitlines() if line.strip())
    text = re.split(r"\s\d+ \| ", text)[0]            # the grammar listing that follows
    return (text[:300] + "…" if len(text) > 300 else text) or type(exc).__name__
