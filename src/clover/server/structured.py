"""Structured output on /v1/chat/completions: `response_format` and strict tool arguments → a grammar.

`response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` become an llguidance JSON-schema grammar for the answer;
a function with `"strict": true` under tool_choice "required" or a named function becomes a Lark grammar
for the rest of the call the prompt opened (`NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n…`), each
value written as the template writes it (strings raw, other types as JSON of their schema). Under
tool_choice "auto" with strict tools, the answer is free text, but a call it opens (`<tool_call>`)
must be written whole to a declared function, by its schema. When the prompt leaves the
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


def call_lark(tools: list[dict], prefill: str) -> str | None:
    """Lark for the rest of a call opened by `prefill` when its function(s) are strict (None: none is)."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if prefill.endswith(">\n"):                      # named: "<tool_call>\n<function=NAME>\n"
        name = prefill[len("<tool_call>\n<function="):-2]
        fn = functions[name]
        if not fn.get("strict"):
            return None
        return "start: " + _body_rules(fn, "f0", first=True)
    strict = [fn for fn in functions.values() if fn.get("strict")]
    if not strict:
        return None
    if len(strict) != len(functions):
        raise bad_request('tool_choice "required" with strict tools needs every tool strict (or name one)',
                          "tools", "unsupported")
    rules, alts = [], []
    for k, fn in enumerate(strict):
        alts.append(f"f{k}")
        rules.append(f"f{k}: {json.dumps(fn['name'] + '>' + chr(10))} " + _body_rules(fn, f"f{k}", first=True))
    return "start: " + " | ".join(alts) + "\n" + "\n".join(rules)


def auto_lark(tools: list[dict], parallel: bool, think_end_id: int | None) -> str | None:
    """Lark for tool_choice "auto" when the functions are strict (None: none is; 400: only some are,
    since a free call body has no closing path the budget could rely on): any text without
    `<tool_call>`, and each `<tool_call>` it writes followed by a whole call by its function's schema.
    One call at most unless `parallel`. `think_end_id`: the response thinks first, and the thinking
    ends at `</think>` or at a call."""
    functions = [t["function"] for t in tools]
    strict = [fn for fn in functions if fn.get("strict")]
    if not strict:
        return None
    if len(strict) != len(functions):
        raise bad_request('tool_choice "auto" with strict tools needs every tool strict', "tools", "unsupported")
    rules, alts = [], []
    for k, fn in enumerate(functions):
        alts.append(f"f{k}")
        rules.append(f"f{k}: {json.dumps(fn['name'] + '>' + chr(10))} " + _body_rules(fn, f"f{k}", first=True))
    more = "*" if parallel else "?"
    start = (f"start: TEXT <[{think_end_id}]> answer | call_open call {'answer' if parallel else 'TEXT'}"
             if think_end_id is not None else "start: answer")
    return "\n".join([
        start,
        f"answer: (call_open call){more} TEXT",
        "call_open[lazy]: /(.|\\n)*<tool_call>/",      # any text up to the first <tool_call>
        'call: "\\n<function=" (' + " | ".join(alts) + ")",
        "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/",
        *rules])


def _body_rules(fn: dict, prefix: str, first: bool) -> str:
    """`params "</function>\\n</tool_call>"` for one function, followed by its rules' lines."""
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    where = f"tools.{fn['name']}.parameters"
    if params.get("type", "object") != "object" or not isinstance(params.get("properties", {}), dict):
        raise bad_request(f"{where}: a strict function's parameters must be an object schema", "tools", "invalid_schema")
    required = params.get("required", [])
    if not isinstance(required, list):
        raise bad_request(f"{where}.required must be a list", "tools", "invalid_schema")
    seq, lines = [], []
    for k, (arg, schema) in enumerate(params.get("properties", {}).items()):
        rule = f"{prefix}_p{k}"
        open_ = json.dumps(f"<parameter={arg}>\n")
        lines.append(f"{rule}: {open_} {_value(schema, f'{where}.properties.{arg}')} " + json.dumps("\n</parameter>\n"))
        seq.append(rule if arg in required else rule + "?")
    head = " ".join(seq + [json.dumps("</function>\n</tool_call>")])
    return head + ("\n" + "\n".join(lines) if lines else "")


def _value(schema, where: str) -> str:
    """One parameter's value as the template writes it: a raw string, else JSON of its schema."""
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", "tools", "invalid_schema")
    types = schema.get("type")
    if types == "string":
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [schema.get("const")])
            if not values or not all(isinstance(v, str) and "\n" not in v and "<" not in v for v in values):
                raise bad_request(f"{where}: a strict string enum needs one-line values without '<'", "tools",
                                  "invalid_schema")
            return "(" + " | ".join(json.dumps(v) for v in values) + ")"
        for key in ("pattern", "format", "minLength", "maxLength"):
            if key in schema:
                raise bad_request(f"{where}: {key} on a raw string parameter is not supported in strict mode",
                                  "tools", "unsupported")
        return _RAW_STRING
    if isinstance(types, list) and "string" in types or any("string" == s.get("type") for s in
                                                            schema.get("anyOf", []) if isinstance(s, dict)):
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

    def lark(self, req, plan, thinking: bool) -> tuple[str, str, bool] | None:
        """(Lark grammar, the request field it comes from, whether the model thinks first) for a chat
        request, or None (unconstrained)."""
        schema = answer_schema(req.response_format)
        call = call_lark(plan.tools, plan.prefill) if plan.prefill and plan.tools else None
        if schema is not None and plan.parse:
            raise bad_request("response_format other than text cannot be combined with tools that may be called: "
                              'use tool_choice "none" or strict tools', "response_format", "unsupported")
        if call is not None:
            return call, "tools", False             # the prompt opened the call with thinking off
        if plan.parse and not plan.prefill:        # tool_choice "auto": the thinking is in its grammar
            think_end = self.tokenizer.think_end_token_id if thinking else None
            if thinking and think_end is None:
                raise bad_request("this model has no </think> token: strict tools cannot be enforced "
                                  "while it thinks", "tools", "unsupported")
            auto = auto_lark(plan.tools, plan.parallel, think_end)
            if auto is not None:
                return auto, "tools", False
        if schema is None:
            return None
        lark = "start: " + Grammars.json_rule(schema)
        return lark, "response_format", thinking

    def matcher(self, lark: str, param: str, thinking: bool, settings):
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
            raise bad_request(f"{param}: the schema cannot be enforced: {_first_line(exc)}", param,
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


def _first_line(exc: Exception) -> str:
    """llguidance's message without its grammar position ("at 3(9): ") and state dump."""
    text = re.sub(r"^at \d+\(\d+\): ", "", str(exc).strip())
    text = " ".join(line.strip() for line in text.split("<state>")[0].splitlines() if line.strip())
    text = re.split(r"\s\d+ \| ", text)[0]            # the grammar listing that follows
    return (text[:300] + "…" if len(text) > 300 else text) or type(exc).__name__
