"""Chat templates as a model ships them: the demo's jinja template and a sandboxed renderer.

`TOOL_CHAT_TEMPLATE` is the demo tokenizer's template: Qwen-style turns (SPEC §11) plus Qwen3.6's tool
format. Tools are listed as JSON lines inside `<tools>…</tools>` in the system turn; an assistant's
calls are written `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n…</function>\\n
</tool_call>` (strings raw, other values as JSON); tool results come back in a user turn, one
`<tool_response>…</tool_response>` per result. A chat of plain `{role, content}` messages without tools
renders exactly as the SPEC §11 template always did, so the shipped demo model's prompts are unchanged.

`render_template` renders any template the way transformers' `apply_chat_template` does: an
`ImmutableSandboxedEnvironment` (templates come from model directories: untrusted code) with
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`, and the same input clean-up (keys whose value is None dropped,
`reasoning`/`thinking` aliased to `reasoning_content`, everything copied to plain JSON types).
jinja2 is imported on first use: plain chats on the demo template never need it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

# Every tag trims the whitespace on both sides ({%- -%}, {{- -}}), so the indentation below never
# reaches the output and the result does not depend on trim_blocks / lstrip_blocks.
TOOL_CHAT_TEMPLATE = """\
{%- set tool_list = tools if tools else [] -%}
{%- if tool_list -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- messages[0].content + '\\n\\n' -}}
    {%- endif -%}
    {{- '# Tools\\n\\nYou may call one or more of these functions:\\n\\n<tools>' -}}
    {%- for tool in tool_list -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, reply in this format:\\n\\n<tool_call>\\n<function=NAME>\\n'
        '<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = message.content if message.content is defined else '' -%}
    {%- if content is not string -%}
        {{- raise_exception('message content must be a string') -}}
    {%- endif -%}
    {%- if loop.first and message.role == 'system' and tool_list -%}
        {#- written above, with the tools -#}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content is defined and message.reasoning_content is string
              and message.reasoning_content and loop.index0 > ns.last_user -%}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set call = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\\n' -}}
                {%- elif content -%}
                    {{- '\\n\\n' -}}
                {%- endif -%}
                {{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}
                {%- set arguments = call.arguments if call.arguments is defined else {} -%}
                {%- if arguments is not mapping -%}
                    {{- raise_exception('tool call arguments must be an object, not a JSON string') -}}
                {%- endif -%}
                {%- for name, value in arguments | items -%}
                    {{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson)
                        + '\\n</parameter>\\n' -}}
                {%- endfor -%}
                {{- '</function>\\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}
        {{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# Names a message's reasoning may come under; templates read the first (as in transformers).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def is_plain_chat(messages: Sequence[Mapping], tools=None) -> bool:
    """A chat the SPEC §11 renderer can write: no tools, only {role, content} with string content."""
    if tools:
        return False
    return all(set(k for k, v in m.items() if v is not None) <= {"role", "content"}
               and isinstance(m.get("content", ""), str) for m in messages)


def render_template(template: str, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = False, special_tokens: Mapping[str, Any] | None = None,
                    **kwargs) -> str:
    """Render `template` as transformers' `apply_chat_template(..., tokenize=False)` would.

    `special_tokens` (e.g. {"eos_token": "<|im_end|>"}) are visible to the template as variables, as
    transformers passes its tokenizer's special tokens; `kwargs` (chat_template_kwargs such as
    `enable_thinking`) override them, and are overridden by the chat itself (messages, tools, …). Raises jinja2's TemplateError when the template rejects its input."""
    chat = [_clean_message(m) for m in messages]
    variables = {**_plain(dict(special_tokens or {})), **_plain(kwargs),
                 "messages": chat, "tools": _plain(list(tools)) if tools is not None else None,
                 "documents": None, "add_generation_prompt": add_generation_prompt}
    return _compile(template).render(**variables)


def _clean_message(message: Mapping) -> dict:
    """What a template sees of one message: None-valued keys dropped (templates test `is defined`),
    reasoning under every name templates read, plain JSON types only."""
    if not isinstance(message, Mapping):
        raise TypeError(f"a chat message must be a dict, got {type(message).__name__}")
    m = {k: v for k, v in _plain(dict(message)).items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def _plain(value):
    """A copy made of JSON types only, so nothing the sandbox does not know reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):        # pydantic models (e.g. openai's types)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _TemplateDict:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=8)
def _compile(template: str):
    """The template compiled in a sandbox with the globals and filters chat templates expect."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        # No underscore attributes: a namespace must not become a way to reach Python internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=_TemplateDict(),
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)
