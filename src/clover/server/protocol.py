"""The OpenAI-compatible wire format: request models, errors, and request → generation settings.

Requests are pydantic models in strict mode (a string is not a number) that allow extra fields:
the block-diffusion settings (`block_size`, `threshold`, `decoding`, `draft_steps`, `top_k`,
`do_sample`, `block_expert_top_p`, every `dllm_*`), and the server switches `enable_thinking` /
`chat_template_kwargs`, `skip_special_tokens`, `ignore_eos` (vLLM's) and `step_events` (a stream's
denoising steps, step_events.py) travel as extras. Unknown extras are an error, so a misspelt setting is never silently ignored.
Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..generation.settings import GenerationSettings

# Generation settings a request may set by name (max_tokens maps to max_new_tokens).
SETTING_EXTRAS = GenerationSettings.field_names() - {"max_new_tokens", "eos_token_id", "temperature", "top_p",
                                                     "seed", "max_block_size"}     # the last: the operator's
SERVER_EXTRAS = {"enable_thinking", "chat_template_kwargs", "skip_special_tokens", "ignore_eos",
                 "tool_call_grammar", "step_events"}
# OpenAI fields we accept and ignore when they ask for nothing we would do differently.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier"}


class APIError(Exception):
    """An error response in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):       # (it crosses from the body worker's process: by default only the message would)
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, with its location as `param` (union branch names dropped)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or ("[" not in str(p) and str(p) not in
                                                                   ("str", "int", "float", "bool"))]
    param = ".".join(loc) if loc else None
    if err["type"] == "missing":
        return bad_request(f"{param}: this field is required", param, "missing_field")
    return bad_request(f"{param}: {err['msg']} (got {_short(err.get('input'))})", param, "invalid_type")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def chars(self) -> int:
        """The length of `text()`, without joining it."""
        if self.content is None or isinstance(self.content, str):
            return len(self.content or "")
        return sum(len(part.text) for part in self.content) + max(len(self.content) - 1, 0)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None


class ChatRequest(_Common):      # tools / tool_choice: see chat_tools.py
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


def parse(model_cls, data) -> BaseModel:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_body")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_unsupported(req: _Common) -> None:
    """Reject OpenAI features we do not implement, rather than ignore them (logprobs, top_logprobs and
    echo are checked in logprobs.py)."""
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1 (one completion per request), got {req.n}", "n", "unsupported")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if v not in (None, 0):
            raise bad_request(f"{name} is not supported; use dllm_repetition_penalty", name, "unsupported")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias", "unsupported")
    if not isinstance(req, ChatRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {req.best_of}", "best_of", "unsupported")


def stop_strings(req: _Common) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise bad_request(f"stop takes at most 4 strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    return stop


def extras(req: _Common) -> dict:
    """The extra fields, checked: generation settings and server switches; anything else is an error."""
    data = dict(req.model_extra or {})
    for name in IGNORED_FIELDS:
        data.pop(name, None)
    if "max_new_tokens" in data:
        raise bad_request("max_new_tokens is not a request field: use max_tokens", "max_new_tokens")
    unknown = sorted(k for k in data if k not in SETTING_EXTRAS | SERVER_EXTRAS)
    if unknown:
        raise bad_request(
            f"unknown field(s): {', '.join(unknown)}; block-diffusion settings are "
            f"{', '.join(sorted(SETTING_EXTRAS))}", unknown[0], "unknown_field")
    return data


def settings_overrides(req: _Common, extra: dict) -> tuple[dict, int | None]:
    """Generation-setting overrides for a request, and the max_tokens it asked for (None: default).

    OpenAI semantics: temperature 0 is greedy; a temperature > 0 (or top_p < 1) samples unless the
    request sets `do_sample` itself; with neither, the model's generation_config decides."""
    over = {k: v for k, v in extra.items() if k in SETTING_EXTRAS}
    max_tokens, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param, "invalid_value")
        over["max_new_tokens"] = max_tokens
    if req.temperature is not None:
        t = req.temperature
        if math.isnan(t) or not 0 <= t <= 2:
            raise bad_request(f"temperature must lie in [0, 2], got {t}", "temperature", "invalid_value")
        if t > 0:
            over["temperature"] = t
        over.setdefault("do_sample", t > 0)
    if req.top_p is not None:
        if math.isnan(req.top_p) or not 0 < req.top_p <= 1:
            raise bad_request(f"top_p must lie in (0, 1], got {req.top_p}", "top_p", "invalid_value")
        over["top_p"] = req.top_p
        if req.top_p < 1:
            over.setdefault("do_sample", True)
    if req.seed is not None:
        over["seed"] = req.seed
    ignore_eos = extra.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos", "invalid_type")
    if ignore_eos:
        over["eos_token_id"] = []      # generate exactly max_tokens (benchmarks)
    return over, (max_tokens if max_tokens is not None else None)


def setting_param(message: str, max_tokens_param: str = "max_tokens") -> str | None:
    """The request field a GenerationSettingsError message is about (its first word, usually)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first == "max_new_tokens":
        return max_tokens_param
    if first in GenerationSettings.field_names():
        return first
    if message.startswith("prompt"):
        return "prompt"
    return None
