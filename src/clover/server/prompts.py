"""A request body → the checked request and its prompt ids: the part of the two POST routes that needs
no engine.

Kept apart so that it runs in the same way in a thread of the server (small bodies) and in the
worker process for large ones (`bodies.py`): the same checks in the same order, the same APIErrors.
What it returns is plain data (picklable); the routes go on with the engine from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..tokenization import CloverTokenizer
from . import step_events
from .chat_tools import ToolPlan, prepare_chat
from .logprobs import chat_top_k, completion_top_k
from .protocol import (APIError, ChatRequest, CompletionRequest, bad_request, check_unsupported, extras, parse,
                       stop_strings)

MAX_JSON_DEPTH = 64     # OpenAI bodies nest a few levels; deeper is an attack on the parser


def parse_json(body: bytes):
    """UTF-8 JSON → a value, checked by check_json_value; APIError 400 otherwise."""
    try:
        value = json.loads(body.decode("utf-8"))   # json.loads(bytes) would also take UTF-16/32
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON (UTF-8): {exc}", None, "invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    check_json_value(value)
    return value


def check_json_value(value) -> None:
    """Reject what json.loads accepts but the rest of the server cannot take: nesting deeper than
    MAX_JSON_DEPTH (recursive validators would overflow the stack) and lone UTF-16 surrogates
    (`"\\ud800"`: not encodable as UTF-8, so the tokenizer would raise). Iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"the request body contains a lone UTF-16 surrogate ({text[exc.start]!a} at character "
                          f"{exc.start} of a string); send valid Unicode", None, "invalid_json") from None


@dataclass(frozen=True)
class ServedModel:
    """What the checks need to know of the server: its model's name, context and longest token."""
    name: str
    context_limit: int
    max_token_bytes: int        # the most bytes of text one token stands for

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.name}'",
                           "invalid_request_error", "model", "model_not_found")

    def refuse_by_length(self, chars: int, param: str) -> None:
        """Refuse at once, before templating or tokenizing, a prompt that cannot fit by its length
        alone: a token stands for at most `max_token_bytes` bytes, so it needs at least
        chars / max_token_bytes tokens."""
        least = chars // self.max_token_bytes
        if least > self.context_limit:
            raise bad_request(f"the prompt's {chars} characters need at least {least} tokens (a token stands for "
                              f"at most {self.max_token_bytes} bytes), which exceeds the {self.context_limit}-token "
                              "context", param, "context_length_exceeded")


@dataclass
class ChatPrompt:
    req: ChatRequest
    top_k: int | None           # logprobs asked for (None: not)
    extra: dict                 # the checked extra fields
    stop: list[str]
    thinking: bool              # enable_thinking
    skip: bool                  # skip_special_tokens
    steps: bool                 # step events asked for
    ids: list[int]              # the prompt, templated and tokenized
    plan: ToolPlan


@dataclass
class CompletionPrompt:
    req: CompletionRequest
    top_k: int | None
    extra: dict
    stop: list[str]
    skip: bool
    steps: bool
    ids: list[int]


def chat_prompt(body: bytes, tokenizer: CloverTokenizer, served: ServedModel) -> ChatPrompt:
    """A /v1/chat/completions body parsed, checked, templated and tokenized."""
    req = parse(ChatRequest, parse_json(body))
    served.check_model(req.model)
    check_unsupported(req)
    top_k = chat_top_k(req)
    extra = extras(req)
    stop = stop_strings(req)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"messages.{i}.content is required for role {m.role}", f"messages.{i}.content")
    served.refuse_by_length(sum(m.chars() for m in req.messages), "messages")
    thinking = extra.get("enable_thinking")
    kwargs = extra.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    if thinking is None:
        thinking = kwargs.get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise bad_request(f"enable_thinking must be true or false, got {thinking!r}", "enable_thinking")
    skip = extra.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise bad_request("skip_special_tokens must be true or false", "skip_special_tokens")
    steps = step_events.wanted(extra, req.stream)
    ids, plan = prepare_chat(tokenizer, req, thinking, kwargs)         # template (tools), tokenize
    return ChatPrompt(req, top_k, extra, stop, thinking, skip, steps, ids, plan)


def completion_prompt(body: bytes, tokenizer: CloverTokenizer, served: ServedModel) -> CompletionPrompt:
    """A /v1/completions body parsed, checked and tokenized (a prompt of token ids taken as it is)."""
    req = parse(CompletionRequest, parse_json(body))
    served.check_model(req.model)
    check_unsupported(req)
    top_k = completion_top_k(req)
    extra = extras(req)
    stop = stop_strings(req)
    for name in ("enable_thinking", "chat_template_kwargs"):
        if name in extra:
            raise bad_request(f"{name} applies to chat completions only", name)
    skip = extra.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise bad_request("skip_special_tokens must be true or false", "skip_special_tokens")
    steps = step_events.wanted(extra, req.stream)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request, got {len(prompt)}", "prompt", "unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        served.refuse_by_length(len(prompt), "prompt")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", "prompt")
    return CompletionPrompt(req, top_k, extra, stop, skip, steps, ids)


PREPARE = {"chat": chat_prompt, "completion": completion_prompt}
